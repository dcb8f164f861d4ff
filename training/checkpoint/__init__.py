"""Checkpoints: the file format and RNG states (format.py), a run's numbered files (files.py), FSDP's sharded
directories (sharded.py) and their consolidation (consolidate.py), and saving and resuming a run (resume.py)."""
