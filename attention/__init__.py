"""Attention backends by name. `get_attention("sdpa")(q, k, v, causal=True)`; `list_attention()`.

`why_not(name, q, k, v, causal)` says why a backend cannot run an input; `flash_kernels(q, k, v, causal)` which of
flash's kernels run it, and why. Both take the variants too (window=, softcap=, doc_ids=; GQA from the shapes):
attention/registry.py defines them, docs/flash.md (Variants) says which backend runs which.
"""

from attention.registry import (
    AttentionFn,
    BackendStatus,
    UnknownBackendError,
    UnsupportedInputError,
    backend_names,
    get_attention,
    graph_replay,
    list_attention,
    register,
    register_decode,
    why_not,
    why_not_decode,
)

# Importing a backend module registers it; the order here is the order list_attention() shows.
from attention import naive, sdpa, flex  # noqa: E402,F401  isort: skip
from attention import flash  # noqa: E402,F401  isort: skip  (registers "flash", then "flash-torch")
from attention import decode  # noqa: E402,F401  isort: skip  (decode paths of naive, sdpa, flex)
from attention.flash import KernelChoice, use_kernels  # noqa: E402  isort: skip
from attention.flash import choose_kernels as flash_kernels  # noqa: E402  isort: skip

__all__ = [
    "AttentionFn",
    "BackendStatus",
    "KernelChoice",
    "UnknownBackendError",
    "UnsupportedInputError",
    "backend_names",
    "flash_kernels",
    "get_attention",
    "graph_replay",
    "list_attention",
    "register",
    "register_decode",
    "use_kernels",
    "why_not",
    "why_not_decode",
]
