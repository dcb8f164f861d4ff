"""Profiling helpers for the benchmarks: NVTX ranges, a torch.profiler run with a kernel table, CUDA memory snapshots."""
