"""flash's Gluon kernels for Hopper (sm_90), with FlashAttention-3's schedule: host.py (launches, plans),
kernels.py (the Gluon kernels, imported on first use), resources.py (compiled for sm_90 without a GPU)."""
