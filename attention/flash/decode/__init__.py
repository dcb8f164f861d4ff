"""flash's split-KV decode attention (flash-decoding): host.py (the PyTorch version and the launches, registered as
the decode paths of `flash` and `flash-torch`), tiles.py (the tiles and split count a shape gets), kernels.py (the
Triton kernels)."""
