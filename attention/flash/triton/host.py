"""flash's FlashAttention-2 kernels in Triton, host side: tile configurations, autotuning, launches.

The kernels are in kernels.py; the design is described in docs/flash.md. `forward` and `backward` run any
input the `flash` backend accepts, on the GPU or in the CPU interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from attention.flash.common import as_bhsd, bounds_of, empty, empty_like, on_device_of

try:
    import triton
except ImportError:  # the flash backend reports it through its environment check; flash-torch still works
    triton = None


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


# Kept short on purpose: every config is a compile the first time a shape is seen. These are the configs that won
# scripts/flash_tile_sweep.py's sweeps for d_head 64-128 in bf16 (docs/flash.md, Tiles and autotuning); smaller tiles
# remain in DEFAULT_TILES.
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
WORK_ORDER_BLOCK = 64  # work items a program of work_order ranks
DQ_FROM_ACCUMULATOR_BLOCK_M = 64  # memory bound; not tuned

_FALLBACK_SMEM_BYTES = 227 * 1024  # Hopper's per-block opt-in limit, if the device cannot be asked
_MAX_ACC_REGS_PER_THREAD = 128  # fp32 accumulator registers per thread before spills become likely


# Plain integer arithmetic: triton.next_power_of_2 and triton.cdiv are constexpr_functions in newer triton, 2-9 us
# a call, and these run on every launch.
def _block_d(d_head: int) -> int:
    return max(16, 1 << (d_head - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    """FLASH_ATTN_AUTOTUNE=0 launches DEFAULT_TILES instead of autotuning: no tuning runs, e.g. in short test runs."""
    return os.environ.get("FLASH_ATTN_AUTOTUNE", "1").strip() not in ("0", "false", "off", "no")


# ----------------------------------------------------------------------------------------------------------
# The kernel module
# ----------------------------------------------------------------------------------------------------------

_kernel_module = None


def _kernels():
    """The kernel module, imported on first use (TRITON_INTERPRET must be set before this)."""
    global _kernel_module
    if _kernel_module is None:
        from attention.flash.triton import kernels

        _kernel_module = kernels
    return _kernel_module


# Constant to torch.compile: Dynamo calls it while tracing instead of tracing it. Traced, its read of _kernel_module
# became a guard on that global, which the first compiled call then sets (flash_op loads the kernels while the
# compiler runs it on fake tensors), and Dynamo failed building a guard on a module ("Unexpected type").
@torch.compiler.assume_constant_result
def interpreting() -> bool:
    """Whether kernels run in the Triton CPU interpreter: fixed once the kernels are loaded."""
    if _kernel_module is not None:
        return _kernel_module.INTERPRET
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def installed() -> bool:
    return triton is not None


# ----------------------------------------------------------------------------------------------------------
# Launching
# ----------------------------------------------------------------------------------------------------------


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t.stride())  # type: ignore[return-value]


def _dot_precision(dtype: torch.dtype, block_d: int) -> str:
    # fp32: 3xTF32, fp32-accurate on tensor cores (docs/flash.md, Precision). 16-bit inputs ignore it. Head dims
    # above 128 keep "ieee": tf32x3 at fp32 d_head 256 hit an illegal memory access (triton 3.6).
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
# triton adds the tensors' dtypes to the key itself. The window's size is not in it: the tiles that win at one
# size are the ones tuned at the first size seen.
_AUTOTUNE_KEY = ["N_Q", "N_K", "D", "CAUSAL", "GROUP", "WINDOW", "SOFTCAP", "DOCS"]


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
# directly: going through the Autotuner again costs host time on every launch (docs/flash.md, Tiles and autotuning),
# and short sequences are bound by host time.
_tuned: dict[tuple, Tiles] = {}


def _tiles_of(config) -> Tiles:
    return Tiles(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)


def _launchable(fn, traceable: bool):
    """fn itself, or fn through torch.library.wrap_triton, as a triton_op must launch it to be seen by torch.compile."""
    return torch.library.wrap_triton(fn) if traceable else fn


def _tuned_key(kernel: str, seq_lens: tuple[int, int], meta: dict, like: torch.Tensor) -> tuple:
    """What the autotuner keys a kernel's choice on (_AUTOTUNE_KEY and the dtypes, which follow q's), plus the
    device: the key of _tuned."""
    return (kernel, *seq_lens, meta["D"], meta["CAUSAL"], meta["GROUP"], meta["WINDOW"], meta["SOFTCAP"],
            meta["DOCS"], like.dtype, like.device)


def _grid(kernel: str, seq_lens: tuple[int, int], bh: int, own: int) -> tuple[int, int]:
    """(tiles of the kernel's own axis, bh): the dK/dV kernel owns key tiles of `own` rows, the others query tiles."""
    return _cdiv(seq_lens[1] if kernel == "dkdv" else seq_lens[0], own), bh


def _launch(kernel: str, seq_lens: tuple[int, int], bh: int, args: tuple, n_tensors: int, meta: dict,
            like: torch.Tensor, tiles: Optional[Tiles], traceable: bool = False) -> Optional["Launch"]:
    """Run `kernel` over a (tiles of its own axis, bh) grid, with `tiles` or the mode's choice of tiles.

    seq_lens is (n_q, n_k); the dK/dV kernel owns key tiles, the others query tiles. args: n_tensors tensors, then
    numbers. `traceable`: see _launchable. Returns the launch resolved (see Launch), or None where the autotuner
    or the compiler launched it."""
    if tiles is None and not interpreting() and _autotune_enabled():
        key = _tuned_key(kernel, seq_lens, meta, like)
        tiles = _tuned.get(key)
        if tiles is None:
            # Traced, the autotuner goes to Inductor, which tunes it when the compiled code first runs and keeps the
            # choice in its own on-disk autotune cache; nothing is recorded here.
            tuner = _autotuned(kernel)
            grid_block = "BLOCK_N" if kernel == "dkdv" else "BLOCK_M"  # the tile each program owns
            _launchable(tuner, traceable)[lambda m: _grid(kernel, seq_lens, bh, m[grid_block])](*args, **meta)
            if not traceable:
                _tuned[key] = _tiles_of(tuner.best_config)
            return None
    if tiles is None:
        if interpreting():
            tiles = INTERPRET_TILES[kernel]
        else:
            limit = _smem_limit(like.device.index or 0)
            tiles = _default_tiles(kernel, meta["BLOCK_D"], like.element_size(), limit)
    own = tiles.block_n if kernel == "dkdv" else tiles.block_m
    return _run(getattr(_kernels(), _KERNEL_NAMES[kernel]), _grid(kernel, seq_lens, bh, own), args, n_tensors,
                {**meta, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n},
                {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}, traceable)


class Launch:
    """A kernel launch resolved once: the kernel for its grid, and every argument after the tensors.

    `launch(*tensors)` launches it again with other tensors in the kernel's order, with no look-up. The compiled
    kernel is specialised on each tensor's dtype and 16-byte alignment: the tensors must match those it was resolved
    with (a tensor of the same data pointer stands for its view)."""

    __slots__ = ("run", "rest")

    def __init__(self, run, rest: tuple):
        self.run, self.rest = run, rest

    def __call__(self, *tensors: torch.Tensor) -> None:
        self.run(*tensors, *self.rest)


# Compiled kernels by launch key. A launch seen before calls the compiled kernel directly, skipping triton's binding
# and specialisation of every argument and its cache look-up (docs/flash.md, Tiles and autotuning).
_compiled: dict[tuple, Launch] = {}
_MAX_COMPILED = 4096  # distinct launches kept (shapes, dtypes, alignments); past it the cache starts again


def _launch_key(jit_fn, grid: tuple[int, ...], args: tuple, n_tensors: int, constexprs: dict, options: dict,
                device: Optional[int]) -> tuple:
    """What triton specialises a launch's arguments on: each tensor's dtype and 16-byte alignment, each integer's
    value (it specialises on 1, on multiples of 16 and on 64-bit sizes), the constants and options; plus the grid.
    args: the tensors, then the numbers. Triton's runtime settings (triton.knobs) count as they were at a key's
    first launch."""
    tensors = args[:n_tensors]
    return (jit_fn, device, grid, *constexprs.values(), *options.values(), *args[n_tensors:],
            *[t.dtype for t in tensors], *[t.data_ptr() % 16 == 0 for t in tensors])


def _resolved(jit_fn, grid: tuple[int, ...], args: tuple, n_tensors: int, constexprs: dict,
              options: dict) -> Optional[Launch]:
    """The Launch of jit_fn[grid](*args, **constexprs, **options): on the GPU its compiled kernel, None when it has
    not been compiled yet; in the interpreter, the interpreted kernel."""
    if interpreting() or not args[0].is_cuda:
        return Launch(functools.partial(jit_fn[grid], **constexprs, **options), args[n_tensors:])
    return _compiled.get(_launch_key(jit_fn, grid, args, n_tensors, constexprs, options, args[0].device.index))


def _run(jit_fn, grid: tuple[int, ...], args: tuple, n_tensors: int, constexprs: dict, options: dict,
         traceable: bool = False) -> Optional[Launch]:
    """jit_fn[grid](*args, **constexprs, **options), from the compiled kernel when this launch was seen before;
    returns its Launch (None when traced).

    args: the kernel's first n_tensors parameters are tensors, the rest up to its tl.constexpr parameters (which
    follow them in its signature) numbers."""
    if traceable:  # traced launches belong to the compiler
        _launchable(jit_fn, traceable)[grid](*args, **constexprs, **options)
        return None
    launch = _resolved(jit_fn, grid, args, n_tensors, constexprs, options)
    if launch is not None:
        launch(*args[:n_tensors])
        return launch
    compiled = jit_fn[grid](*args, **constexprs, **options)
    if len(_compiled) >= _MAX_COMPILED:
        _compiled.clear()
    constants = tuple(constexprs[name] for name in jit_fn.arg_names[len(args):])  # in signature order
    launch = Launch(compiled[(*grid, 1, 1)[:3]], (*args[n_tensors:], *constants))  # a compiled kernel takes 3 axes
    _compiled[_launch_key(jit_fn, grid, args, n_tensors, constexprs, options, args[0].device.index)] = launch
    return launch


def _meta(q: torch.Tensor, causal: bool, groups: int = 1, window: Optional[int] = None,
          softcap: Optional[float] = None, docs: bool = False) -> dict:
    d = q.shape[-1]
    block_d = _block_d(d)
    return {"D": d, "BLOCK_D": block_d, "CAUSAL": causal, "DOT_PRECISION": _dot_precision(q.dtype, block_d),
            "GROUP": groups, "WINDOW": window is not None, "SOFTCAP": softcap is not None, "DOCS": docs}


def _variant_args(scale: float, window: Optional[int], softcap: Optional[float], bounds: Optional[tuple],
                  dummy: torch.Tensor) -> tuple:
    """(START, END, qk_scale, cap_scale, cap_log2e, window): what the kernels take for the variants.

    START, END: each position's document bounds, int32 (batch, seq) (`bounds`, from attention.masks.doc_bounds), or
    `dummy` (never read) without documents. Softcap: the base-2 scores are cap_log2e * tanh(cap_scale * q.k), so the
    kernels' qk_scale is 1.
    """
    start, end = (dummy, dummy) if bounds is None else bounds
    log2e = math.log2(math.e)
    if softcap is None:
        return start, end, scale * log2e, 0.0, 0.0, window or 0
    return start, end, 1.0, scale / softcap, softcap * log2e, window or 0


def _groups(q4: torch.Tensor, k4: torch.Tensor) -> int:
    return q4.shape[1] // k4.shape[1]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
            tiles: Optional[Tiles] = None, traceable: bool = False, window: Optional[int] = None,
            softcap: Optional[float] = None,
            doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) for validated inputs: o like q (its memory order up to 4 dims), lse fp32 of shape q.shape[:-1].

    tiles: a config to launch instead of the autotuner's. traceable: launch through torch.library.wrap_triton, as
    code inside a triton_op must. window, softcap, doc_ids: the variants (attention/registry.py); k and v may have
    fewer heads than q (GQA).
    """
    o, lse, _ = _forward(q, k, v, causal, scale, tiles, traceable, window, softcap, bounds_of(q, doc_ids))
    return o, lse


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, tiles: Optional[Tiles],
             traceable: bool, window: Optional[int], softcap: Optional[float],
             bounds: Optional[tuple]) -> tuple[torch.Tensor, torch.Tensor, Optional[Launch]]:
    """forward(), and its launch resolved (None where the autotuner or the compiler launched it); bounds: the
    documents' (see _variant_args)."""
    q4, k4, v4 = as_bhsd(q), as_bhsd(k), as_bhsd(v)
    b, h, n_q, d = q4.shape
    n_k = k4.shape[-2]
    # Outputs are allocated in the caller's shape; the kernel writes through (b, h, ...) views.
    o = empty_like(q)
    lse = empty(tuple(q.shape[:-1]), torch.float32, q.device)
    o4 = as_bhsd(o)
    start, end, qk_scale, cap_scale, cap_log2e, window_arg = _variant_args(scale, window, softcap, bounds, lse)
    args = (q4, k4, v4, o4, lse, start, end, *_strides(q4), *_strides(k4), *_strides(v4), *_strides(o4),
            h, n_q, n_k, qk_scale, cap_scale, cap_log2e, window_arg)
    meta = _meta(q, causal, _groups(q4, k4), window, softcap, bounds is not None)
    with on_device_of(q):
        launch = _launch("fwd", (n_q, n_k), b * h, args, 7, meta, q, tiles, traceable)
    return o, lse, launch


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
             do: torch.Tensor, causal: bool, scale: float, tiles: Optional[dict[str, Tiles]] = None,
             traceable: bool = False, window: Optional[int] = None, softcap: Optional[float] = None,
             doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by recomputation from lse, each like its input. tiles ({"dkdv": ..., "dq": ...}) replaces the
    autotuner's configs of those kernels; traceable and the variants as in `forward`. With GQA, each key/value
    head's dK/dV program sums over its query heads in turn: deterministic, no atomics."""
    dq, dk, dv, _ = _backward(q, k, v, o, lse, do, causal, scale, tiles, traceable, window, softcap,
                              bounds_of(q, doc_ids))
    return dq, dk, dv


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
              do: torch.Tensor, causal: bool, scale: float, tiles: Optional[dict[str, Tiles]], traceable: bool,
              window: Optional[int], softcap: Optional[float], bounds: Optional[tuple]) -> tuple:
    """(dq, dk, dv, launches): backward(), and its launches resolved (dQ, then dK/dV, which reads the delta dQ
    writes), None unless both were; bounds as in _forward."""
    tiles = tiles or {}
    q4, k4, v4, o4, do4 = (as_bhsd(t) for t in (q, k, v, o, do))
    lse = lse.contiguous()  # the kernels index it as (b * h, n_q)
    b, h, n_q, d = q4.shape
    n_k = k4.shape[-2]
    groups = _groups(q4, k4)
    meta = _meta(q, causal, groups, window, softcap, bounds is not None)
    dq, dk, dv = (empty_like(t) for t in (q, k, v))
    dq4, dk4, dv4 = as_bhsd(dq), as_bhsd(dk), as_bhsd(dv)
    start, end, qk_scale, cap_scale, cap_log2e, window_arg = _variant_args(scale, window, softcap, bounds, lse)
    rowsum = empty((b, h, n_q), torch.float32, q.device)  # delta = rowsum(dO * O): the dQ kernel writes it
    with on_device_of(q):
        args = (q4, k4, v4, o4, do4, lse, rowsum, dq4, start, end, *_strides(q4), *_strides(k4), *_strides(v4),
                *_strides(o4), *_strides(do4), *_strides(dq4), h, n_q, n_k, qk_scale, scale, cap_scale, cap_log2e,
                window_arg)
        dq_launch = _launch("dq", (n_q, n_k), b * h, args, 10, meta, q, tiles.get("dq"), traceable)
        args = (q4, k4, v4, do4, lse, rowsum, dk4, dv4, start, end, *_strides(q4), *_strides(k4), *_strides(v4),
                *_strides(do4), *_strides(dk4), *_strides(dv4), h, n_q, n_k, qk_scale, scale, cap_scale, cap_log2e,
                window_arg)
        dkdv_launch = _launch("dkdv", (n_q, n_k), b * (h // groups), args, 10, meta, q, tiles.get("dkdv"), traceable)
    launches = (dq_launch, dkdv_launch)
    return dq, dk, dv, None if None in launches else launches


def delta_and_launch(o4: torch.Tensor, do4: torch.Tensor,
                     acc: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Launch]:
    """rowsum(dO * O) in fp32, (batch, heads, seq): the softmax-backward term the Hopper backward kernels read (the
    Triton dQ kernel computes its own); and its launch resolved, `launch(o4, do4, delta, acc)` (acc: delta itself
    when not given). acc: the fused Hopper backward's (batch * heads, d, seq) fp32 accumulator, zeroed by the same
    launch."""
    b, h, n_q, d = o4.shape
    out = empty((b, h, n_q), torch.float32, o4.device)
    launch = _run(_kernels().attn_bwd_delta, (_cdiv(n_q, DELTA_BLOCK_M), b * h),
                  (o4, do4, out, out if acc is None else acc, *_strides(o4), *_strides(do4), h, n_q), 4,
                  {"D": d, "BLOCK_D": _block_d(d), "BLOCK_M": DELTA_BLOCK_M, "ZERO_ACC": acc is not None}, {})
    return out, launch


def dq_from_accumulator(acc: torch.Tensor, dq4: torch.Tensor, scale: float) -> Launch:
    """Writes dq4 ((batch, heads, seq, d), any memory order) = scale * the fp32 accumulator acc ((batch * heads, seq,
    d), the fused Hopper backward's); returns the launch resolved."""
    b, h, n_q, d = dq4.shape
    return _run(_kernels().dq_from_accumulator, (_cdiv(n_q, DQ_FROM_ACCUMULATOR_BLOCK_M), b * h),
                (acc, dq4, *_strides(dq4), h, n_q, scale), 2, {"D": d, "BLOCK_M": DQ_FROM_ACCUMULATOR_BLOCK_M}, {})


def work_order(starts: torch.Tensor, ends: torch.Tensor, n: int, rows: int, tile: int, causal: bool,
               window: Optional[int]) -> tuple[torch.Tensor, Launch]:
    """The (sequence, block) pairs of `rows` query rows, (batch * blocks,) int32 as sequence * blocks + block, by the
    key tiles of `tile` rows each streams, most first (ties in index order), for documents bounded by starts and
    ends ((batch, n) int32); and its launch resolved. The Hopper forward's persistent programs take their work items
    in this order (hopper/kernels.py, _work_item)."""
    items = starts.shape[0] * _cdiv(n, rows)
    order = empty((items,), torch.int32, starts.device)
    launch = _run(_kernels().work_order, (_cdiv(items, WORK_ORDER_BLOCK), 1),
                  (starts, ends, order, items, n, window or 0), 3,
                  {"CAUSAL": causal, "WINDOW": window is not None, "ROWS": rows, "TILE": tile,
                   "BLOCK": WORK_ORDER_BLOCK}, {})
    return order, launch


# ----------------------------------------------------------------------------------------------------------
# Plans: a forward or backward resolved for one input signature
# ----------------------------------------------------------------------------------------------------------
# Eager calls of short sequences are bound by host time (docs/flash.md). A plan repeats a forward or backward for
# inputs of the same shapes, strides, dtype, device and 16-byte alignment as the call it was made from: it allocates
# the outputs and launches the compiled kernels, and does nothing else. It passes each tensor itself where the
# kernels took its (batch, heads, seq, d) view: the same data pointer, as long as the tensor has at most 4 dims.


def plannable(*tensors: torch.Tensor) -> bool:
    """Whether a plan can stand for a call on these tensors: at most 4 dims each, and on the current device (the
    launches go to its stream)."""
    if any(t.dim() > 4 for t in tensors):
        return False
    return not tensors[0].is_cuda or tensors[0].device.index == torch.cuda.current_device()


class ForwardPlan:
    """forward() of one input signature, resolved: `plan(q, k, v, bounds) -> (o, lse)`, bounds the call's document
    bounds (attention.masks.doc_bounds) where the signature has documents, else None."""

    __slots__ = ("launch", "lse_shape")

    def __init__(self, launch: Launch, lse_shape: tuple[int, ...]):
        self.launch, self.lse_shape = launch, lse_shape

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 bounds: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
        o = empty_like(q)
        lse = empty(self.lse_shape, torch.float32, q.device)
        self.launch(q, k, v, o, lse, *(bounds or (lse, lse)))  # START, END: unread without documents
        return o, lse


class BackwardPlan:
    """backward() of one input signature, resolved: `plan(q, k, v, o, lse, do, bounds) -> (dq, dk, dv)`, bounds as
    in ForwardPlan."""

    __slots__ = ("dq", "dkdv", "rowsum_shape")

    def __init__(self, launches: tuple[Launch, Launch], rowsum_shape: tuple[int, ...]):
        (self.dq, self.dkdv), self.rowsum_shape = launches, rowsum_shape

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                 do: torch.Tensor, bounds: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
        rowsum = empty(self.rowsum_shape, torch.float32, q.device)
        start, end = bounds or (lse, lse)
        self.dq(q, k, v, o, do, lse, rowsum, dq, start, end)
        self.dkdv(q, k, v, do, lse, rowsum, dk, dv, start, end)
        return dq, dk, dv


def planned_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                    window: Optional[int] = None, softcap: Optional[float] = None, bounds: Optional[tuple] = None,
                    tiles: Optional[Tiles] = None,
                    traceable: bool = False) -> tuple[torch.Tensor, torch.Tensor, Optional[ForwardPlan]]:
    """(o, lse) as forward() computes them (bounds: the documents' bounds, ForwardPlan's), and the plan that repeats
    the call for inputs of the same signature; None where there is none yet (the autotuner launched the kernel) or
    can be none (traced, more than 4 dims)."""
    o, lse, launch = _forward(q, k, v, causal, scale, tiles, traceable, window, softcap, bounds)
    if launch is None or not plannable(q, k, v):
        return o, lse, None
    return o, lse, ForwardPlan(launch, tuple(lse.shape))


def planned_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                     do: torch.Tensor, causal: bool, scale: float, window: Optional[int] = None,
                     softcap: Optional[float] = None, bounds: Optional[tuple] = None,
                     tiles: Optional[dict[str, Tiles]] = None, traceable: bool = False) -> tuple:
    """(dq, dk, dv, plan): backward(), and the plan that repeats it, as planned_forward. The plan needs lse
    contiguous, as forward() makes it."""
    dq, dk, dv, launches = _backward(q, k, v, o, lse, do, causal, scale, tiles, traceable, window, softcap, bounds)
    if launches is None or not plannable(q, k, v, o, do) or not lse.is_contiguous():
        return dq, dk, dv, None
    return dq, dk, dv, BackwardPlan(launches, tuple(as_bhsd(o).shape[:-1]))
