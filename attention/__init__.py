"""Attention backends by name. `get_attention("sdpa")(q, k, v, causal=True)`; `list_attention()`."""

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
    why_not,
)

# Importing a backend module registers it; the order here is the order list_attention() shows.
from attention import naive, sdpa, flex  # noqa: E402,F401  isort: skip
from attention import flash_triton, flash_torch  # noqa: E402,F401  isort: skip

__all__ = [
    "AttentionFn",
    "BackendStatus",
    "UnknownBackendError",
    "UnsupportedInputError",
    "backend_names",
    "get_attention",
    "graph_replay",
    "list_attention",
    "register",
    "why_not",
]
