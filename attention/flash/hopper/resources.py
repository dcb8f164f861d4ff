"""Compile flash's Gluon Hopper kernels for sm_90 on any machine, no GPU needed: shared memory, registers, spills.

Spills ruled out several of the Hopper kernels' tile configs (hopper.backward_tiles_for), and ptxas reports them
without a device: `python -m attention.flash.hopper.resources` compiles the configs the dispatch picks at the
benchmark shapes, or those given as `kind,d,consumers,block_n,stages[,causal[,masks[,persistent]]]`, masks being w
(a window), d (documents) or wd, persistent 1 for the forward's persistent grid (a `p` after the stages in the table):

    python -m attention.flash.hopper.resources dkdv,128,2,64,4 fwd,64,2,128,3,0 dq,64,3,64,4,1,wd fwd,64,2,64,4,1,d,1

The report comes from the installed Triton and its ptxas, whose releases spill differently for the same source: read
it for the Triton that will run the kernels. A config without spills is not always faster (docs/flash.md). Integer
arguments are compiled as multiples of 16, as Triton specialises them for the shapes the Hopper kernels accept.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch

from attention.flash.hopper.host import _shared_layout, _stats_layout
from attention.flash.hopper.inputs import OFF_GPU_SMS
from attention.flash.hopper.tiles import HopperTiles, backward_tiles_for, fused_dq_cols, tiles_for

# Rows of each TMA block: a consumer's resident rows ("m") or a streamed tile's ("n"), as host.py launches them.
DESCRIPTOR_ROWS = {
    "fwd": dict(q_desc="m", k_desc="n", v_desc="n", o_desc="m"),
    "dkdv": dict(q_desc="n", k_desc="m", v_desc="m", do_desc="n", dk_desc="m", dv_desc="m", lse_desc="n",
                 delta_desc="n"),
    "dq": dict(q_desc="m", k_desc="n", v_desc="n", do_desc="m", dq_desc="m"),
}
DESCRIPTOR_ROWS["fused"] = DESCRIPTOR_ROWS["dkdv"]
# fused: the dK/dV kernel that computes dQ too (the backward unless deterministic)
KERNELS = {"fwd": "attn_fwd_hopper", "dkdv": "attn_bwd_dkdv_hopper", "dq": "attn_bwd_dq_hopper",
           "fused": "attn_bwd_dkdv_hopper"}
ARG_TYPES = {"qk_scale": "fp32", "scale": "fp32", "L": "*fp32", "DELTA": "*fp32", "START": "*i32", "END": "*i32",
             "ORDER": "*i32"}
ROW_STATS = ("lse_desc", "delta_desc")  # 1-D fp32 descriptors over L and delta
Config = tuple[str, int, HopperTiles, bool, str]  # kind, d, tiles, causal, masks


@dataclass(frozen=True)
class KernelResources:
    kind: str
    d: int
    tiles: HopperTiles
    causal: bool
    masks: str  # "", "w", "d" or "wd": a window, documents
    shared_bytes: int
    warps: int  # launched, every partition's warps together
    registers: Optional[int]  # per thread at launch (ptxas -v); None if ptxas did not say
    spill_bytes: Optional[int]  # bytes of spill stores plus spill loads


def _descriptor_type(rows: int, d: int, row_stats: bool) -> str:
    """The signature type of a descriptor argument, with the shared-memory layout host.py's launches use."""
    if row_stats:
        return f"tensordesc<fp32[{rows}],{_stats_layout()!r}>"
    return f"tensordesc<bf16[{rows}, {d}],{_shared_layout(rows, d, torch.bfloat16)!r}>"


def compile_kernel(kind: str, d: int, tiles: HopperTiles, causal: bool = True, masks: str = ""):
    """The Triton CompiledKernel of flash's `kind` ("fwd", "dkdv", "dq" or "fused") Hopper kernel for bf16 at head dim
    d, with `masks` ("w": a window, "d": documents, "wd": both)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from attention.flash.hopper import kernels as hopper_kernels
    from attention.flash.hopper.host import _meta, accumulator_layout, fused_meta

    if kind not in KERNELS:
        raise ValueError(f"kind must be one of {', '.join(KERNELS)}, got {kind!r}")
    fn = getattr(hopper_kernels, KERNELS[kind])
    meta = _meta(tiles, causal, window="w" in masks, docs="d" in masks)
    if kind == "fwd":
        meta["PERSISTENT"] = tiles.persistent
    if kind == "fused":
        meta.update(fused_meta(tiles, d, torch.bfloat16))
    num_warps = meta.pop("num_warps")
    rows = {"m": tiles.block_m, "n": tiles.block_n}
    signature, attrs = {}, {}
    for i, (name, param) in enumerate(inspect.signature(fn.fn).parameters.items()):
        if name not in meta and param.default is not inspect.Parameter.empty:
            meta[name] = param.default  # a compile-time argument host.py's launches leave at its default
        if name in meta:
            signature[name] = "constexpr"
        elif name in DESCRIPTOR_ROWS[kind]:
            signature[name] = _descriptor_type(rows[DESCRIPTOR_ROWS[kind][name]], d, name in ROW_STATS)
        elif name == "dq_acc_desc":  # the fused backward's dQ accumulator, None otherwise
            if kind == "fused":
                rows, cols = tiles.block_n, fused_dq_cols(d, tiles.consumers)
                signature[name] = f"tensordesc<fp32[{rows}, {cols}],{accumulator_layout(rows, cols)!r}>"
            else:
                signature[name], meta[name] = "constexpr", None
        else:
            signature[name] = ARG_TYPES.get(name, "i32")
            if signature[name] != "fp32" and name != "window":
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = GluonASTSource(fn, signature, meta, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def _ptxas_report(ptx: str) -> tuple[Optional[int], Optional[int]]:
    """(registers, spill bytes) from `ptxas -v` on the kernel's PTX, or Nones where no ptxas takes it."""
    from triton import knobs

    path = knobs.nvidia.ptxas.path
    # triton 3.9's `ptxas` is older than the PTX its compiler writes; its `ptxas-blackwell` takes it.
    candidates = [path, os.path.join(os.path.dirname(path), "ptxas-blackwell")]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        for ptxas in candidates:
            if not os.path.exists(ptxas):
                continue
            out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                                 text=True)
            text = out.stdout + out.stderr
            regs = re.search(r"Used (\d+) registers", text)
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
            if out.returncode == 0 and regs and spills:
                return int(regs.group(1)), int(spills.group(1)) + int(spills.group(2))
    finally:
        os.unlink(f.name)
    return None, None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def _spec(kind: str, d: int, tiles: HopperTiles, causal: bool, masks: str) -> str:
    return f"{kind},{d},{tiles.consumers},{tiles.block_n},{tiles.stages},{int(causal)},{masks},{int(tiles.persistent)}"


def _resources_without_interpreter(configs: list[Config]) -> list[KernelResources]:
    """resources_of() in Pythons without TRITON_INTERPRET, one per CPU core, each compiling its share of the configs.
    With TRITON_INTERPRET set, triton.jit makes Triton's own library functions (gl.max's combine function among them)
    interpreter functions, which no GPU compile can use."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    workers = max(1, min(len(configs), os.cpu_count() or 1))
    shares = [configs[i::workers] for i in range(workers)]
    running = [subprocess.Popen([sys.executable, "-m", "attention.flash.hopper.resources", "--json",
                                 *(_spec(*config) for config in share)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for share in shares]
    outputs = [process.communicate() for process in running]  # all finished before any error is raised
    measured = {}
    for share, process, (stdout, stderr) in zip(shares, running, outputs):
        if process.returncode != 0:
            specs = " ".join(_spec(*config) for config in share)
            raise RuntimeError(f"compiling {specs} for sm_90 failed:\n{stderr[-4000:]}")
        for config, line in zip(share, stdout.splitlines()[-len(share):]):
            row = json.loads(line)
            measured[config] = KernelResources(*config, row["shared_bytes"], row["warps"], row["registers"],
                                               row["spill_bytes"])
    return [measured[config] for config in configs]


def resources_of(configs: list[Config]) -> list[KernelResources]:
    """resources() of each (kind, d, tiles, causal, masks), compiled in this process, or under TRITON_INTERPRET in
    one subprocess per CPU core rather than one per config (each subprocess imports torch anew)."""
    for kind, *_ in configs:
        if kind not in KERNELS:
            raise ValueError(f"kind must be one of {', '.join(KERNELS)}, got {kind!r}")
    if _interpreting():
        return _resources_without_interpreter(configs)
    out = []
    for kind, d, tiles, causal, masks in configs:
        kernel = compile_kernel(kind, d, tiles, causal, masks)
        registers, spills = _ptxas_report(kernel.asm["ptx"])
        out.append(KernelResources(kind, d, tiles, causal, masks, kernel.metadata.shared, kernel.metadata.num_warps,
                                   registers, spills))
    return out


def resources(kind: str, d: int, tiles: HopperTiles, causal: bool = True, masks: str = "") -> KernelResources:
    """Shared memory, warps, registers and spills of flash's `kind` Hopper kernel compiled for sm_90."""
    return resources_of([(kind, d, tiles, causal, masks)])[0]


def dispatch_configs() -> list[tuple[str, int, HopperTiles, bool]]:
    """(kind, d, tiles, causal) the dispatch picks on an H100 at the benchmark shapes and the `large` model's, and the
    forward's for documents, for a window of 1024 keys and for both."""
    shapes = [(1, 16, 16384, 64, True), (2, 16, 8192, 128, True), (2, 16, 8192, 64, False), (4, 20, 1024, 64, True),
              (8, 16, 1024, 128, True)]
    configs = []
    for b, h, n, d, causal in shapes:
        configs.append(("fwd", d, tiles_for(d, n, b * h, OFF_GPU_SMS, causal=causal), causal))
        configs.append(("fwd", d, tiles_for(d, n, b * h, OFF_GPU_SMS, docs=True), causal))
        configs.append(("fwd", d, tiles_for(d, n, b * h, OFF_GPU_SMS, window=1024), causal))
        configs.append(("fwd", d, tiles_for(d, n, b * h, OFF_GPU_SMS, window=1024, docs=True), causal))
        for kind, t in backward_tiles_for(d, n, b * h, OFF_GPU_SMS).items():
            configs.append((kind, d, t, causal))
        # the backward unless deterministic
        configs.append(("fused", d, backward_tiles_for(d, n, b * h, OFF_GPU_SMS, fused=True)["dkdv"], causal))
    return list(dict.fromkeys(configs))


MASKS = ("", "w", "d", "wd")


def _parse(spec: str) -> Config:
    parts = spec.split(",")
    if len(parts) not in (5, 6, 7, 8):
        raise argparse.ArgumentTypeError(
            f"expected kind,d,consumers,block_n,stages[,causal[,masks[,persistent]]], got {spec!r}")
    kind, d, consumers, block_n, stages = parts[0], *map(int, parts[1:5])
    if kind not in KERNELS:
        raise argparse.ArgumentTypeError(f"kind must be one of {', '.join(KERNELS)}, got {kind!r}")
    masks = parts[6] if len(parts) >= 7 else ""
    if masks not in MASKS:
        raise argparse.ArgumentTypeError(f"masks must be one of w, d, wd or empty, got {masks!r}")
    persistent = len(parts) == 8 and parts[7] != "0"
    if persistent and kind != "fwd":
        raise argparse.ArgumentTypeError(f"only the forward runs persistent, got {spec!r}")
    tiles = HopperTiles(consumers, block_n, stages, persistent=persistent)
    return kind, d, tiles, parts[5] != "0" if len(parts) >= 6 else True, masks


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", type=_parse,
                        help="kind,d,consumers,block_n,stages[,causal[,masks[,persistent]]]")
    parser.add_argument("--json", action="store_true", help="print one JSON object per config instead of a table")
    args = parser.parse_args(argv)
    configs = args.configs or [(*config, "") for config in dispatch_configs()]
    measured = resources_of(configs)
    if args.json:
        for (kind, d, t, causal, masks), r in zip(configs, measured):
            print(json.dumps({"kind": kind, "d": d, "consumers": t.consumers, "block_n": t.block_n,
                              "stages": t.stages, "persistent": t.persistent, "causal": causal, "masks": masks,
                              "shared_bytes": r.shared_bytes, "warps": r.warps, "registers": r.registers,
                              "spill_bytes": r.spill_bytes}), flush=True)
        return
    # spill B: bytes of spill stores plus spill loads; regs: per thread at launch
    print(f"{'kernel':6s} {'d':>4s} {'tiles':16s} {'causal':6s} {'masks':5s} {'shared KiB':>10s} {'regs':>5s} "
          f"{'spill B':>7s}")
    for (kind, d, t, causal, masks), r in zip(configs, measured):
        tiles = f"c{t.consumers} m{t.block_m} n{t.block_n} s{t.stages}" + ("p" if t.persistent else "")
        regs, spills = ("?" if x is None else x for x in (r.registers, r.spill_bytes))
        print(f"{kind:6s} {d:4d} {tiles:16s} {str(causal):6s} {masks or '-':5s} {r.shared_bytes / 1024:10.1f} "
              f"{regs:>5} {spills:>7}", flush=True)


if __name__ == "__main__":
    main()
