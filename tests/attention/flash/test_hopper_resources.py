"""flash's Gluon Hopper kernels compile for sm_90 with the installed Triton, on any machine (no GPU needed).

A Triton release can rename what the kernels call (3.9 made `tma.async_copy_global_to_shared` raise), which would
otherwise surface only as a compile error at the first Hopper launch of a user's run. Compiling needs triton's
NVIDIA backend and the Gluon Hopper API; each kernel takes a few seconds.
"""

from __future__ import annotations

import pytest
import triton

from attention.flash.hopper import inputs as hopper_inputs, resources as hopper_resources
from attention.flash.hopper.tiles import HopperTiles
from attention.flash.hopper.resources import KernelResources, dispatch_configs, main, resources, resources_of

H100_SHARED_BYTES = 227 * 1024  # the most shared memory one block of an H100 can take

if hopper_inputs.gluon_problem() is not None:
    pytest.skip(hopper_inputs.gluon_problem(), allow_module_level=True)

# Configs the dispatch picks on an H100, each kernel and head dim (the full list: dispatch_configs()).
CONFIGS = [("fwd", 64, HopperTiles(3, 128, 3)), ("fwd", 128, HopperTiles(2, 128, 3)),
           ("dkdv", 64, HopperTiles(2, 64, 4)), ("dkdv", 128, HopperTiles(2, 32, 4)), ("dq", 64, HopperTiles(3, 64, 4)),
           ("dq", 128, HopperTiles(2, 64, 4)), ("fwd", 64, HopperTiles(3, 64, 4, persistent=True)),
           ("fwd", 128, HopperTiles(2, 64, 4, persistent=True)), ("fwd", 128, HopperTiles(3, 64, 3, persistent=True)),
           ("fwd", 128, HopperTiles(3, 64, 3)), ("fused", 64, HopperTiles(2, 64, 4))]


MASKED = CONFIGS[:7:2] + CONFIGS[7:10]  # each kernel at d 64, and the d 128 forwards of windows and documents


@pytest.fixture(scope="module")
def compiled() -> dict:
    """KernelResources of every config below, plain and with both masks, by (kind, d, tiles, masks): compiled in one
    batch (a few seconds each; under the interpreter, one subprocess per CPU core)."""
    configs = [(kind, d, t, True, "") for kind, d, t in CONFIGS] + [(kind, d, t, True, "wd") for kind, d, t in MASKED]
    return {(r.kind, r.d, r.tiles, r.masks): r for r in resources_of(configs)}


def test_configs_are_the_dispatchs():
    picked = {(kind, d, t) for kind, d, t, _ in dispatch_configs()}
    assert set(CONFIGS) <= picked


@pytest.mark.slow  # the fixture compiles 17 kernels for sm_90: a minute or more on 2 CPU cores
@pytest.mark.parametrize("kind,d,tiles", CONFIGS, ids=[f"{k}-d{d}-c{t.consumers}n{t.block_n}s{t.stages}"
                                                      + ("p" if t.persistent else "") for k, d, t in CONFIGS])
def test_kernel_compiles_for_sm90_within_shared_memory(compiled, kind, d, tiles):
    r = compiled[kind, d, tiles, ""]
    # At least the kernel's own bf16 tiles: the resident ones (Q, twice when persistent; K and V; Q and dO) and a ring
    # of two streamed tensors.
    resident = 2 if kind != "fwd" or tiles.persistent else 1
    tiles_bytes = (resident * tiles.rows + 2 * tiles.stages * tiles.block_n) * d * 2
    assert tiles_bytes <= r.shared_bytes <= H100_SHARED_BYTES, f"{r.shared_bytes} bytes of shared memory"
    assert r.warps >= 4 * tiles.consumers + 1  # a warpgroup per consumer, and the producer's warp
    if r.registers is not None:  # one block must fit the SM's 65536 registers
        assert r.registers * 32 * r.warps <= 65536
    # The tiles were chosen on the GPU machine's triton 3.6, where none of them spills; other releases differ
    # (3.9 spills the three-consumer d-64 forward), so this holds only there.
    if triton.__version__.startswith("3.6.") and r.spill_bytes is not None:
        assert r.spill_bytes == 0, f"{kind} d{d} {tiles} spills {r.spill_bytes} bytes under triton 3.6"


def test_report_prints_a_row_per_config(capsys, monkeypatch):
    # The table of what resources_of returns (the compiles are the tests above).
    def measured(configs):
        return [KernelResources(*config, shared_bytes=1024 * (i + 1), warps=12, registers=168, spill_bytes=0)
                for i, config in enumerate(configs)]

    monkeypatch.setattr(hopper_resources, "resources_of", measured)
    main(["dq,64,2,64,4", "dkdv,128,2,32,4,0", "fwd,64,2,64,4,1,d,1"])
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0].split()[:2] == ["kernel", "d"]
    assert [r.split()[:2] for r in rows[1:]] == [["dq", "64"], ["dkdv", "128"], ["fwd", "64"]]
    assert rows[2].split()[6] == "False"
    assert rows[3].split()[5:8] == ["s4p", "True", "d"]
    assert [r.split()[-3:] for r in rows[1:]] == [[f"{i}.0", "168", "0"] for i in (1, 2, 3)]


def test_bad_config_is_refused():
    for spec in ("dq,64,2", "bwd,64,2,64,4", "dq,64,two,64,4", "dq,64,2,64,4,1,d,1"):
        with pytest.raises(SystemExit):
            main([spec])
    with pytest.raises(ValueError, match="kind must be one of"):
        resources("bwd", 64, HopperTiles(2, 64, 4))


@pytest.mark.slow  # the compiles of the fixture
@pytest.mark.parametrize("kind,d,tiles", MASKED, ids=lambda x: str(x))
def test_masked_kernels_compile_for_sm90(compiled, kind, d, tiles):
    """The window and document masks (constexpr WINDOW, DOCS) compile, within the same shared memory."""
    plain, masked = compiled[kind, d, tiles, ""], compiled[kind, d, tiles, "wd"]
    assert masked.masks == "wd" and masked.warps == plain.warps
    assert plain.shared_bytes <= masked.shared_bytes <= H100_SHARED_BYTES
