"""`flash`: FlashAttention-2 in Triton, forward and backward (`FlashAttentionTriton`, an autograd.Function).

Design note
-----------
Algorithm (FlashAttention-2). Forward: one program per (query tile, batch*head). The query tile stays on
chip while key/value tiles stream past; an online softmax keeps a running row max m, row sum l and an
unnormalised output acc, rescaling by exp(m_old - m_new) when the max grows. Only O and the log-sum-exp
L = m + log(l) (fp32, natural log, shape q.shape[:-1]) are written: memory is O(seq * d_head), never
O(seq^2). Backward recomputes P = exp(scale * q k^T - L) tile by tile instead of storing it:
  1. a pre-pass computes delta = rowsum(dO * O) (fp32), so dS = P * (dP - delta);
  2. the dK/dV kernel: one program per key tile, k and v on chip, streaming query tiles;
  3. the dQ kernel: one program per query tile, streaming key tiles.
Splitting dQ from dK/dV costs one extra recomputation of P but needs no atomics, so gradients are
bitwise deterministic (two backward passes on the same inputs agree exactly).

Causal. Tiles wholly above the diagonal are skipped by the loop bounds, not masked. Each loop is split
into the off-diagonal part (every key visible: no mask) and the diagonal band (masked), and a ragged
last tile (seq not a multiple of the tile) is its own masked call. Masks are compile-time flags, so the
hot loop does no mask work. Causal query tiles are launched heaviest first to shorten the tail.

Precision. Scores, softmax statistics and all accumulators are fp32. The softmax runs in base 2:
qk_scale = scale * log2(e) multiplies the fp32 scores (not q, which would round q once more in
fp16/bf16), and exp2 is a single MUFU instruction on NVIDIA GPUs. P and dS are cast to the input dtype
before their tl.dot, as in FlashAttention-2, so fp16/bf16 matmuls run on tensor cores with fp32
accumulation. fp32 inputs use tl.dot(input_precision="tf32x3"): each operand is split into a tf32 part
and a tf32 remainder and three tensor-core products are summed, which keeps fp32-level accuracy (plain
tf32 rounds the inputs to 10 mantissa bits, ~1e-3 per product, which leaves no margin against a float64
reference). "ieee" gives the same accuracy on the FMA units, and ran 5.7x slower at the seed sweep's
B8 N16384 d64 point on the H100 (results/README.md); head dims above 128 still use it (see
_dot_precision). bf16/fp16 remain the fast paths.

Shapes. Any leading dims (..., seq, d_head) are flattened to (batch, heads) without a copy where a view
exists (strides go to the kernel, so e.g. a transposed (b, s, h, d) tensor is read in place). Head dims
16..256 of any size: the head-dim block is padded to the next power of two and masked. Any seq >= 1;
q_len may differ from k_len when not causal. Offsets are int64, so tensors over 2^31 elements work.

Tiles. `@triton.autotune` on the GPU over FWD/DKDV/DQ_SEARCH_SPACE below (pruned by a shared-memory and
register estimate), keyed on the sequence lengths, head dim, causal and dtype, with timings cached on
disk when the installed triton supports it. FLASH_ATTN_AUTOTUNE=0 uses one fixed config per kernel
(DEFAULT_TILES) instead, e.g. for quick test runs. Under TRITON_INTERPRET=1 (CPU) the one small
INTERPRET_TILES config runs. The kernels themselves are in flash_triton_kernels.py.

Hopper kernels. On an sm_90 GPU, bf16/fp16 inputs with head dim 64 or 128, as many keys as queries, a sequence
that is a multiple of 128 and at least flash_hopper.min_scores(...) scores (fewer when the launches are replayed
from a CUDA graph: attention.graph_replay, or a capture in progress) run the forward and the backward in
flash_hopper_kernels.py: Gluon kernels with a TMA producer warp and two or three consumer warpgroups, each
overlapping the elementwise work of one tile with the matmuls of the tile before (FlashAttention-3's schedule,
which Triton's compiler does not produce from the kernels above). They read and write the same O, L and gradients,
and the backward keeps the Triton delta pre-pass. flash_hopper.forward_problem / backward_problem say why an input
does not qualify; FLASH_HOPPER_FORWARD=0 / FLASH_HOPPER_BACKWARD=0, or forced `tiles`, keep the Triton kernels.

torch.compile. Eager code calls the autograd.Function. Compiled code calls the flash_op / flash_backward_op
triton_ops at the bottom of this file: Inductor launches the kernels itself and runs the same autotuner (or the
tiles an eager call already chose for that shape). In the CPU interpreter it calls opaque custom ops instead.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from attention import flash_hopper
from attention.registry import (UnsupportedInputError, graph_replay_requested, launches_replayed, register,
                                validate_qkv)

try:
    import triton
except ImportError:  # flash reports it through environment_check; flash-torch still works
    triton = None

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GRID_Y = 65535  # batch * heads goes on CUDA grid axis 1

# Tests set this to allocate outputs and gradients filled with NaN, proving the kernels write every element.
_poison_outputs = False


# ----------------------------------------------------------------------------------------------------------
# Tile configurations: the one place to tune.
# BLOCK_M is always the query tile, BLOCK_N the key tile. The forward and dQ kernels need
# BLOCK_M % BLOCK_N == 0 and the dK/dV kernel BLOCK_N % BLOCK_M == 0 (the causal band is whole tiles).
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Kept short on purpose: every config is a compile (1-2 s each) the first time a shape is seen. These are
# the configs that won on the H100 for d_head 64-128 in bf16 (tests/gpu/flash_tile_sweep.py, 11-16 configs per
# kernel on the shapes, results/README.md); smaller tiles remain in DEFAULT_TILES.
FWD_SEARCH_SPACE = [Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 4), Tiles(128, 128, 8, 3),
                    Tiles(128, 128, 8, 2), Tiles(128, 32, 4, 4), Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 4),
                    Tiles(64, 32, 4, 4)]
DKDV_SEARCH_SPACE = [Tiles(32, 128, 4, 3), Tiles(32, 128, 8, 3), Tiles(64, 128, 8, 3), Tiles(64, 128, 8, 2),
                     Tiles(32, 64, 4, 3), Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 2), Tiles(128, 128, 8, 2)]
DQ_SEARCH_SPACE = [Tiles(128, 32, 4, 3), Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 2), Tiles(128, 64, 8, 4),
                   Tiles(128, 64, 4, 3), Tiles(128, 32, 8, 3), Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 4),
                   Tiles(64, 32, 4, 3)]
SEARCH_SPACES = {"fwd": FWD_SEARCH_SPACE, "dkdv": DKDV_SEARCH_SPACE, "dq": DQ_SEARCH_SPACE}

# Without autotuning: the first of these that fits the head dim and dtype with margin (at most
# _DEFAULT_ACC_REGS accumulator registers per thread and 3/4 of the shared memory estimate, see _fits:
# nothing benchmarks these, so a config that runs out of resources would just fail); the last is the
# fallback.
DEFAULT_TILES = {
    "fwd": [Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 3), Tiles(64, 64, 4, 3), Tiles(64, 32, 8, 2), Tiles(64, 16, 8, 1)],
    "dkdv": [Tiles(32, 128, 8, 3), Tiles(32, 64, 4, 3), Tiles(32, 64, 8, 2), Tiles(32, 32, 8, 2), Tiles(16, 32, 8, 1)],
    "dq": [Tiles(128, 64, 8, 3), Tiles(64, 64, 4, 3), Tiles(64, 32, 8, 2), Tiles(64, 16, 8, 1)],
}
_DEFAULT_ACC_REGS = 64

# The CPU interpreter: small tiles, so short test sequences still span several tiles, a causal band of
# two key tiles and ragged edges.
INTERPRET_TILES = {"fwd": Tiles(32, 16, 4, 1), "dkdv": Tiles(16, 32, 4, 1), "dq": Tiles(32, 16, 4, 1)}

DELTA_BLOCK_M = 64  # the delta pre-pass is memory bound; not tuned

_FALLBACK_SMEM_BYTES = 227 * 1024  # Hopper's per-block opt-in limit, if the device cannot be asked
_MAX_ACC_REGS_PER_THREAD = 128  # fp32 accumulator registers per thread before spills become likely


def _block_d(d_head: int) -> int:
    return max(16, triton.next_power_of_2(d_head) if triton else 1 << (d_head - 1).bit_length())


def _smem_bytes(kernel: str, t: Tiles, block_d: int, elem: int) -> int:
    """Rough shared memory: the resident tile(s) plus num_stages buffers of each streamed tile."""
    if kernel == "fwd":  # q resident; k, v streamed
        rows = t.block_m + 2 * t.num_stages * t.block_n
    elif kernel == "dkdv":  # k, v resident; q, dO streamed
        rows = 2 * t.block_n + 2 * t.num_stages * t.block_m
    else:  # dq: q, dO resident; k, v streamed
        rows = 2 * t.block_m + 2 * t.num_stages * t.block_n
    return rows * block_d * elem


def _acc_regs_per_thread(kernel: str, t: Tiles, block_d: int) -> int:
    acc_rows = 2 * t.block_n if kernel == "dkdv" else t.block_m  # dK and dV, or O / dQ
    return acc_rows * block_d // (32 * t.num_warps)


def _fits(kernel: str, t: Tiles, block_d: int, elem: int, smem_limit: int,
          max_acc_regs: int = _MAX_ACC_REGS_PER_THREAD) -> bool:
    return (
        _smem_bytes(kernel, t, block_d, elem) <= smem_limit
        and _acc_regs_per_thread(kernel, t, block_d) <= max_acc_regs
    )


@functools.cache
def _smem_limit(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", 0) or _FALLBACK_SMEM_BYTES


def _default_tiles(kernel: str, block_d: int, elem: int, smem_limit: int) -> Tiles:
    for t in DEFAULT_TILES[kernel]:
        if _fits(kernel, t, block_d, elem, smem_limit * 3 // 4, _DEFAULT_ACC_REGS):
            return t
    return DEFAULT_TILES[kernel][-1]


def _autotune_enabled() -> bool:
    return os.environ.get("FLASH_ATTN_AUTOTUNE", "1").strip() not in ("0", "false", "off", "no")


# ----------------------------------------------------------------------------------------------------------
# Environment and input checks
# ----------------------------------------------------------------------------------------------------------

_kernel_module = None


def _kernels():
    """The kernel module, imported on first use (TRITON_INTERPRET must be set before this)."""
    global _kernel_module
    if _kernel_module is None:
        from attention import flash_triton_kernels

        _kernel_module = flash_triton_kernels
    return _kernel_module


# Constant to torch.compile: Dynamo calls it while tracing instead of tracing it. Traced, its read of _kernel_module
# became a guard on that global, which the first compiled call then sets (flash_op loads the kernels while the
# compiler runs it on fake tensors), and Dynamo failed building a guard on a module ("Unexpected type").
@torch.compiler.assume_constant_result
def _interpreting() -> bool:
    """Whether kernels run in the Triton CPU interpreter: fixed once the kernels are loaded."""
    if _kernel_module is not None:
        return _kernel_module.INTERPRET
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def _environment_problem() -> Optional[str]:
    if triton is None:
        return "triton is not installed (pip install triton)"
    if _interpreting() or torch.cuda.is_available():
        return None
    return "needs a CUDA GPU, or TRITON_INTERPRET=1 for CPU tensors"


def _input_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Optional[str]:
    d = q.shape[-1]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        return f"head dim {d} is not supported: flash needs {MIN_HEAD_DIM} <= d_head <= {MAX_HEAD_DIM}"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not supported: flash needs float16, bfloat16 or float32"
    if q.device.type == "cpu" and not _interpreting():
        return "CPU tensors need TRITON_INTERPRET=1 (set before the kernels load); otherwise pass CUDA tensors"
    if q.device.type not in ("cpu", "cuda"):
        return f"device {q.device.type} is not supported: flash needs CUDA (or CPU with TRITON_INTERPRET=1)"
    if math.prod(q.shape[:-2]) > MAX_GRID_Y:
        return f"the product of the leading dims is {math.prod(q.shape[:-2])}; flash supports at most {MAX_GRID_Y}"
    return None


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float]) -> float:
    """Raise UnsupportedInputError before any launch; return the resolved scale."""
    validate_qkv(q, k, v, causal)
    reason = _environment_problem() or _input_problem(q, k, v, causal)
    if reason is not None:
        raise UnsupportedInputError(f"attention backend 'flash' cannot run this input: {reason}")
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise UnsupportedInputError(f"flash needs a finite positive scale, got {scale}")
    return scale


# ----------------------------------------------------------------------------------------------------------
# Launching
# ----------------------------------------------------------------------------------------------------------


def _as_bhsd(t: torch.Tensor) -> torch.Tensor:
    """(..., seq, d) -> (batch, heads, seq, d): a view unless the leading dims cannot merge (then a copy)."""
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[None]
    if t.dim() == 4:
        return t
    return t.reshape(-1, *t.shape[-3:])


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t.stride())  # type: ignore[return-value]


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if _poison_outputs:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _alloc_like(t: torch.Tensor) -> torch.Tensor:
    """An output shaped like t and, up to 4 dims, in t's memory order.

    A (batch, heads, seq, d) view of (batch, seq, heads, d) storage gets an output in that order, so the caller's
    "b h s d -> b s (h d)" is a view, as after cuDNN SDPA. Above 4 dims: contiguous, which _as_bhsd can view.
    """
    if t.dim() > 4:
        return _alloc(tuple(t.shape), t.dtype, t.device)
    out = torch.empty_like(t)
    return out.fill_(float("nan")) if _poison_outputs else out


def _dot_precision(dtype: torch.dtype, block_d: int) -> str:
    # fp32: 3xTF32, fp32-accurate on tensor cores (see the design note). 16-bit inputs ignore it.
    # Head dims above 128 keep "ieee": with tf32x3, fp32 d_head 256 hit an illegal memory access on the H100
    # (triton 3.6), and at those sizes the FMA path is what was tested correct there.
    if dtype != torch.float32:
        return "tf32"
    return "tf32x3" if block_d <= 128 else "ieee"


def _prune(kernel: str):
    """early_config_prune for the autotuner: drop configs that cannot fit or are far larger than the seq."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        block_d, elem = args["BLOCK_D"], args["Q"].element_size()
        limit = _smem_limit(args["Q"].device.index or 0)
        max_m = max(64, triton.next_power_of_2(args["N_Q"]))
        max_n = max(64, triton.next_power_of_2(args["N_K"]))
        kept = [
            c
            for c in configs
            if _fits(kernel, Tiles(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages),
                     block_d, elem, limit)
            and c.kwargs["BLOCK_M"] <= max_m
            and c.kwargs["BLOCK_N"] <= max_n
        ]
        if kept:
            return kept
        # Nothing in the search space fits (large head dims in fp32): use the default tiles that do.
        t = _default_tiles(kernel, block_d, elem, limit)
        return [triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n}, num_warps=t.num_warps,
                              num_stages=t.num_stages)]

    return prune


_KERNEL_NAMES = {"fwd": "attn_fwd", "dkdv": "attn_bwd_dkdv", "dq": "attn_bwd_dq"}
_AUTOTUNE_KEY = ["N_Q", "N_K", "D", "CAUSAL"]  # triton adds the tensors' dtypes to the key itself


@functools.cache
def _autotuned(kernel: str):
    """The kernel wrapped in triton.autotune, built once, on first GPU use (so importing needs no GPU).

    Built once, not per launch: a fresh Autotuner has an empty in-memory cache, so every launch would look
    the config up on disk again (hashing, a file read), milliseconds of host time per attention call.
    """
    configs = [
        triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n}, num_warps=t.num_warps, num_stages=t.num_stages)
        for t in SEARCH_SPACES[kernel]
    ]
    options = {"prune_configs_by": {"early_config_prune": _prune(kernel)}}
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        options["cache_results"] = True  # keep timings on disk: a training run does not re-tune each start
    return triton.autotune(configs=configs, key=_AUTOTUNE_KEY, **options)(getattr(_kernels(), _KERNEL_NAMES[kernel]))


# The config the autotuner chose, per kernel and autotune key. Later calls with that key launch the kernel with it
# directly: going through the Autotuner again costs 12-20 us more host time per launch (37-46 against 24-25 us in
# two runs on the H100, tests/gpu/flash_host_breakdown.py), and short sequences are bound by host time.
_tuned: dict[tuple, Tiles] = {}


def _tiles_of(config) -> Tiles:
    return Tiles(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)


def _launchable(fn, traceable: bool):
    """fn itself, or fn through torch.library.wrap_triton, as a triton_op must launch it to be seen by torch.compile."""
    return torch.library.wrap_triton(fn) if traceable else fn


def _launch(kernel: str, seq_lens: tuple[int, int], bh: int, args: tuple, meta: dict, like: torch.Tensor,
            tiles: Optional[Tiles], traceable: bool = False) -> None:
    """Run `kernel` over a (tiles of its own axis, bh) grid, with `tiles` or the mode's choice of tiles.

    seq_lens is (n_q, n_k); the dK/dV kernel owns key tiles, the others query tiles. `traceable`: see _launchable."""
    n_rows_of_grid = seq_lens[1] if kernel == "dkdv" else seq_lens[0]
    grid_block = "BLOCK_N" if kernel == "dkdv" else "BLOCK_M"  # the tile each program owns
    jit_fn = getattr(_kernels(), _KERNEL_NAMES[kernel])
    if tiles is None and not _interpreting() and _autotune_enabled():
        # What the autotuner keys on (_AUTOTUNE_KEY and the dtypes, which follow q's), plus the device.
        key = (kernel, *seq_lens, meta["D"], meta["CAUSAL"], like.dtype, like.device)
        tiles = _tuned.get(key)
        if tiles is None:
            # Traced, the autotuner goes to Inductor, which tunes it when the compiled code first runs and keeps the
            # choice in its own on-disk autotune cache; nothing is recorded here.
            tuner = _autotuned(kernel)
            _launchable(tuner, traceable)[lambda m: (triton.cdiv(n_rows_of_grid, m[grid_block]), bh)](*args, **meta)
            if not traceable:
                _tuned[key] = _tiles_of(tuner.best_config)
            return
    if tiles is None:
        if _interpreting():
            tiles = INTERPRET_TILES[kernel]
        else:
            limit = _smem_limit(like.device.index or 0)
            tiles = _default_tiles(kernel, meta["BLOCK_D"], like.element_size(), limit)
    own = tiles.block_n if kernel == "dkdv" else tiles.block_m
    _launchable(jit_fn, traceable)[(triton.cdiv(n_rows_of_grid, own), bh)](
        *args, **meta, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def _on_device_of(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _meta(q: torch.Tensor, causal: bool) -> dict:
    d = q.shape[-1]
    block_d = _block_d(d)
    return {"D": d, "BLOCK_D": block_d, "CAUSAL": causal, "DOT_PRECISION": _dot_precision(q.dtype, block_d)}


def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, tiles: Optional[Tiles] = None,
    traceable: bool = False, replayed: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) for validated inputs; o like q, lse fp32 of shape q.shape[:-1]. `tiles` forces a Triton config.

    replayed: whether the launches will be replayed from a CUDA graph; None asks registry.launches_replayed().
    """
    q4, k4, v4 = _as_bhsd(q), _as_bhsd(k), _as_bhsd(v)
    replayed = launches_replayed() if replayed is None else replayed
    if tiles is None and flash_hopper.forward_problem(q4, k4, v4, causal, replayed) is None:
        o4, lse4 = (hopper_forward_op if traceable else _hopper_forward)(q4, k4, v4, causal, scale)
        return o4.reshape(q.shape), lse4.reshape(q.shape[:-1])
    b, h, n_q, d = q4.shape
    n_k = k4.shape[-2]
    # Outputs are allocated in the caller's shape; the kernel writes through (b, h, ...) views.
    o = _alloc_like(q)
    lse = _alloc(tuple(q.shape[:-1]), torch.float32, q.device)
    o4 = _as_bhsd(o)
    args = (q4, k4, v4, o4, lse, *_strides(q4), *_strides(k4), *_strides(v4), *_strides(o4),
            h, n_q, n_k, scale * math.log2(math.e))
    with _on_device_of(q):
        _launch("fwd", (n_q, n_k), b * h, args, _meta(q, causal), q, tiles, traceable)
    return o, lse


def _hopper_forward(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    o4 = _alloc_like(q4)
    lse = _alloc(tuple(q4.shape[:-1]), torch.float32, q4.device)
    with _on_device_of(q4):
        flash_hopper.forward(q4, k4, v4, o4, lse, causal, scale)
    return o4, lse


def flash_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
    causal: bool, scale: float, tiles: Optional[dict[str, Tiles]] = None, traceable: bool = False,
    replayed: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by recomputation from lse. `tiles` ({"dkdv": ..., "dq": ...}) forces Triton configs;
    `replayed` as in flash_forward."""
    q4, k4, v4, o4, do4 = _as_bhsd(q), _as_bhsd(k), _as_bhsd(v), _as_bhsd(o), _as_bhsd(do)
    lse = lse.contiguous()  # the kernels index it as (b * h, n_q)
    replayed = launches_replayed() if replayed is None else replayed
    if not tiles and flash_hopper.backward_problem(q4, k4, v4, do4, causal, replayed) is None:
        grads = (hopper_backward_op if traceable else _hopper_backward)(q4, k4, v4, o4, lse, do4, causal, scale)
        return tuple(g4.reshape(t.shape) for g4, t in zip(grads, (q, k, v)))
    tiles = tiles or {}
    b, h, n_q, d = q4.shape
    n_k = k4.shape[-2]
    meta = _meta(q, causal)
    dq, dk, dv = (_alloc_like(t) for t in (q, k, v))
    dq4, dk4, dv4 = _as_bhsd(dq), _as_bhsd(dk), _as_bhsd(dv)
    qk_scale = scale * math.log2(math.e)
    with _on_device_of(q):
        delta = _delta(o4, do4, traceable)
        args = (q4, k4, v4, do4, lse, delta, dk4, dv4, *_strides(q4), *_strides(k4), *_strides(v4),
                *_strides(do4), *_strides(dk4), *_strides(dv4), h, n_q, n_k, qk_scale, scale)
        _launch("dkdv", (n_q, n_k), b * h, args, meta, q, tiles.get("dkdv"), traceable)
        args = (q4, k4, v4, do4, lse, delta, dq4, *_strides(q4), *_strides(k4), *_strides(v4), *_strides(do4),
                *_strides(dq4), h, n_q, n_k, qk_scale, scale)
        _launch("dq", (n_q, n_k), b * h, args, meta, q, tiles.get("dq"), traceable)
    return dq, dk, dv


def _delta(o4: torch.Tensor, do4: torch.Tensor, traceable: bool = False) -> torch.Tensor:
    """rowsum(dO * O) in fp32, (batch, heads, seq): the softmax-backward term both backward kernels read."""
    b, h, n_q, d = o4.shape
    delta = _alloc((b, h, n_q), torch.float32, o4.device)
    _launchable(_kernels().attn_bwd_delta, traceable)[(triton.cdiv(n_q, DELTA_BLOCK_M), b * h)](
        o4, do4, delta, *_strides(o4), *_strides(do4), h, n_q, D=d, BLOCK_D=_block_d(d), BLOCK_M=DELTA_BLOCK_M,
    )
    return delta


def _hopper_backward(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, lse: torch.Tensor,
                     do4: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq4, dk4, dv4 = (_alloc_like(t) for t in (q4, k4, v4))
    with _on_device_of(q4):
        flash_hopper.backward(q4, k4, v4, do4, lse, _delta(o4, do4), dq4, dk4, dv4, causal, scale)
    return dq4, dk4, dv4


class FlashAttentionTriton(torch.autograd.Function):
    """`FlashAttentionTriton.apply(q, k, v, is_causal=False, scale=None)` on (..., seq, d_head)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None):
        causal = bool(is_causal)
        scale = _check(q, k, v, causal, scale)
        o, lse = flash_forward(q, k, v, causal, scale)
        # lse is the only saved tensor shaped q.shape[:-1] (the CS336 harness finds L that way).
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


@register(
    "flash",
    description="FlashAttention-2 in Triton (fused forward and backward, O(seq) memory)",
    environment_check=_environment_problem,
    input_check=_input_problem,
)
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    if torch.compiler.is_compiling():  # the check runs while tracing, not on every call of the compiled code
        op = flash_opaque_op if _interpreting() else flash_op
        # Read while tracing, so the compiled code guards on it; a capture in progress cannot be asked here.
        return op(q, k, v, causal, _check(q, k, v, causal, scale), graph_replay_requested())[0]
    # Eager: the autograd.Function (it checks the inputs itself), whose host time per forward+backward measured
    # 0.78 ms against the custom op's 1.18 ms on the H100 at B4 H20 N1024 (results/README.md); short sequences
    # are bound by host time.
    return FlashAttentionTriton.apply(q, k, v, causal, scale)


# The same kernels as PyTorch operators, which is what the registry's "flash" runs under torch.compile. Without
# them, Dynamo traces into the triton.autotune wrapper and its pruning hook, and Inductor fails to compile them.
# On the GPU: triton_op, which lets the compiler see the Triton kernels inside. Inductor launches them from its
# generated code with its own launcher, as it does its own kernels, and the backward joins the compiled backward
# graph. An opaque custom op instead costs a Python dispatch and Triton's launcher per call: with it, a compiled
# `small` model trained 30% slower with flash than with sdpa on the H100 (results/README.md).
# In the CPU interpreter: custom_op. The compiler cannot trace interpreted kernels (torch.library.wrap_triton hands
# them back unwrapped), so it gets one opaque op with known output shapes (the fake functions below).
# All paths save the same tensors and run the same kernels.
@torch.library.triton_op("flash_lm::flash_attn_fwd", mutates_args=())
def flash_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
             replayed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of validated inputs: o like q (its memory order up to 4 dims), lse fp32 shaped q.shape[:-1].
    replayed: the caller replays the launches from a CUDA graph (flash_forward)."""
    return flash_forward(q, k, v, causal, scale, traceable=True, replayed=replayed)


@torch.library.triton_op("flash_lm::flash_attn_bwd", mutates_args=())
def flash_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                      do: torch.Tensor, causal: bool, scale: float,
                      replayed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), each shaped like its input (and in its memory order up to 4 dims)."""
    return flash_backward(q, k, v, o, lse, do, causal, scale, traceable=True, replayed=replayed)


# The Hopper forward is a Gluon kernel, launched by its own host code rather than through
# torch.library.wrap_triton: inside flash_op it is an opaque op of its own (the backward stays flash_backward_op's).
@torch.library.custom_op("flash_lm::flash_attn_fwd_hopper", mutates_args=())
def hopper_forward_op(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of (batch, heads, seq, d) inputs that flash_hopper.forward_problem accepted."""
    return _hopper_forward(q4, k4, v4, causal, scale)


@hopper_forward_op.register_fake
def _(q4, k4, v4, causal, scale):
    return _alloc_like(q4), q4.new_empty(q4.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("flash_lm::flash_attn_bwd_hopper", mutates_args=())
def hopper_backward_op(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, lse: torch.Tensor,
                       do4: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of (batch, heads, seq, d) inputs that flash_hopper.backward_problem accepted."""
    return _hopper_backward(q4, k4, v4, o4, lse, do4, causal, scale)


@hopper_backward_op.register_fake
def _(q4, k4, v4, o4, lse, do4, causal, scale):
    return _alloc_like(q4), _alloc_like(k4), _alloc_like(v4)


@torch.library.custom_op("flash_lm::flash_attn_fwd_opaque", mutates_args=())
def flash_opaque_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                    replayed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_op as one opaque operator: what a compiled model runs in the CPU interpreter."""
    return flash_forward(q, k, v, causal, scale, replayed=replayed)


@flash_opaque_op.register_fake
def _(q, k, v, causal, scale, replayed):
    return _alloc_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("flash_lm::flash_attn_bwd_opaque", mutates_args=())
def flash_backward_opaque_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                             do: torch.Tensor, causal: bool, scale: float,
                             replayed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_backward(q, k, v, o, lse, do, causal, scale, replayed=replayed)


@flash_backward_opaque_op.register_fake
def _(q, k, v, o, lse, do, causal, scale, replayed):
    return _alloc_like(q), _alloc_like(k), _alloc_like(v)


def _save_for_backward(ctx, inputs, output) -> None:
    q, k, v, causal, scale, replayed = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)  # as FlashAttentionTriton: O(seq) memory, lse the only (..., seq)
    ctx.causal, ctx.scale, ctx.replayed = causal, scale, replayed


def _backward_with(backward_op):
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = backward_op(q, k, v, o, lse, do, ctx.causal, ctx.scale, ctx.replayed)
        return dq, dk, dv, None, None, None

    return backward


flash_op.register_autograd(_backward_with(flash_backward_op), setup_context=_save_for_backward)
flash_opaque_op.register_autograd(_backward_with(flash_backward_opaque_op), setup_context=_save_for_backward)
