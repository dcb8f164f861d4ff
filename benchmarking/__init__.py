"""Benchmark machinery shared by bench_attention.py and bench_model.py: timing, OOM handling, reports."""
