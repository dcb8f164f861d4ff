"""Training machinery shared by train.py and the benchmarks: data, schedule, checkpoints, metrics, logging."""
