"""Several GPUs: the process group and collectives, DDP and FSDP2 wrapping, activation checkpointing."""
