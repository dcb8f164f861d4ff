"""Measure one attention backend at one point: memory, correctness against float64, and fwd/bwd times.

Order per backend, on the shared inputs of the point:
1. warm-up forward+backward (torch.compile, Triton autotuning and allocator growth happen here, untimed);
2. a measured pass: memory before/after/peak of the forward, peak of the backward, the tensors autograd
   saved, and the output and gradients compared with the float64 reference (`attention_reference`);
3. timings (`benchmarking.timing.time_ms`, median over about `iters` calls; `time_again` repeats them for
   further rounds, which bench_attention.py's --rounds takes turns over):
   - fwd: a training forward (inputs require grad, so the graph and saved tensors are built each call);
   - fwdbwd: forward then backward from the same upstream gradient, grads reset to None before each call;
   - bwd: backward alone, timed by replaying one forward's graph with retain_graph=True (grads reset before
     each call). Backends whose backward cannot be replayed (torch.compile frees its saved buffers after
     one backward: "donated buffers") get bwd = fwdbwd - fwd instead; `bwd_method` says which.
4. with `graph_timing` (CUDA): fwd_graph and fwdbwd_graph, the same calls each captured once in a CUDA graph
   (inside attention.graph_replay(), so backends pick the kernels they would under a graphed training step) and
   the replay timed as above: GPU time without the host time of the launches. A backend that cannot be captured
   gets no figure and a note.
A backend whose backward cannot run on this input but whose forward can (FlexAttention on CPU) is
measured forward-only (no grad), and the row's note says why. For `flash` the row also says which kernels ran the
forward and the backward, and why (attention.flash_kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from attention import flash_kernels, get_attention, graph_replay, why_not
from benchmarking.attention_memory import SavedTensor, SavedTensorRecorder
from benchmarking.attention_point import AttentionInputs, AttentionPoint, variant_kwargs
from benchmarking.attention_reference import Reference, errors
from benchmarking.oom import OOM_STATUS, call_catching_oom, free_memory
from benchmarking.timing import (allocated_bytes, captured, peak_allocated_bytes, reset_peak_memory, tflops,
                                 time_ms, to_mib)

TIME_COLUMNS = ("fwd_ms", "bwd_ms", "fwdbwd_ms", "fwd_graph_ms", "fwdbwd_graph_ms")
BWD_RETAIN_GRAPH = "retain_graph"
BWD_DIFFERENCE = "fwdbwd-fwd"


@dataclass
class Measurement:
    row: dict[str, object]  # the figures for the result row (no point/backend identity)
    saved: Optional[list[SavedTensor]]  # what autograd kept for backward, None if not recorded


def _clear_grads(inputs: AttentionInputs) -> None:
    for t in inputs.leaves():
        t.grad = None


def run_mode(name: str, inputs: AttentionInputs, point: AttentionPoint) -> tuple[Optional[str], Optional[str]]:
    """('train', None), ('forward', why backward is skipped) or (None, why it cannot run at all)."""
    variant = variant_kwargs(point, inputs)
    reason = why_not(name, inputs.q, inputs.k, inputs.v, point.causal, **variant)
    if reason is None:
        return "train", None
    with torch.no_grad():  # some backends only lack a backward (their check looks at requires_grad)
        detached = [t.detach() for t in inputs.leaves()]
        forward_reason = why_not(name, *detached, point.causal, **variant)
    if forward_reason is None:
        return "forward", reason
    return None, reason


def _memory_and_correctness(attend: Callable, inputs: AttentionInputs, point: AttentionPoint,
                            ref: Optional[Reference], device: torch.device, train: bool) -> Measurement:
    free_memory()
    reset_peak_memory(device)
    before = allocated_bytes(device)
    saved = None
    if train:
        with SavedTensorRecorder(exclude=inputs.leaves()) as recorder:
            out = attend(inputs.q, inputs.k, inputs.v)
        saved = recorder.tensors
    else:
        with torch.no_grad():
            out = attend(*(t.detach() for t in inputs.leaves()))
    after, fwd_peak = allocated_bytes(device), peak_allocated_bytes(device)
    row: dict[str, object] = {
        "saved_mib": None if before is None else to_mib(after - before),
        "saved_tensors_mib": to_mib(sum(s.nbytes for s in saved)) if saved is not None else None,
        "fwd_peak_mib": None if before is None else to_mib(fwd_peak - before),
        "bwd_peak_mib": None,
    }
    grads = None
    if train:
        reset_peak_memory(device)
        out.backward(inputs.grad_out_check)
        bwd_peak = peak_allocated_bytes(device)
        row["bwd_peak_mib"] = None if before is None else to_mib(bwd_peak - before)
        grads = (inputs.q.grad, inputs.k.grad, inputs.v.grad)
    if ref is not None:
        row.update(errors(ref, inputs, out, point.dtype, grads))
    del out, grads
    _clear_grads(inputs)
    return Measurement(row, saved)


def _times(attend: Callable, inputs: AttentionInputs, point: AttentionPoint, device: torch.device,
           iters: int, warmup: int, train: bool) -> dict[str, object]:
    q, k, v, leaves = inputs.q, inputs.k, inputs.v, inputs.leaves()
    row: dict[str, object] = {"fwd_ms": None, "bwd_ms": None, "fwdbwd_ms": None, "bwd_method": None}
    if not train:
        detached = [t.detach() for t in leaves]
        with torch.no_grad():
            row["fwd_ms"] = time_ms(lambda: attend(*detached), device, iters=iters, warmup=warmup).median_ms
        return row
    row["fwd_ms"] = time_ms(lambda: attend(q, k, v), device, iters=iters, warmup=warmup).median_ms
    row["fwdbwd_ms"] = time_ms(lambda: attend(q, k, v).backward(inputs.grad_out), device, iters=iters,
                               warmup=warmup, grad_to_none=leaves).median_ms
    out = attend(q, k, v)
    try:
        row["bwd_ms"] = time_ms(lambda: out.backward(inputs.grad_out, retain_graph=True), device, iters=iters,
                                warmup=warmup, grad_to_none=leaves).median_ms
        row["bwd_method"] = BWD_RETAIN_GRAPH
    except RuntimeError as exc:
        if "retain_graph" not in str(exc):
            raise
        difference = row["fwdbwd_ms"] - row["fwd_ms"]
        # A negative difference means timing noise exceeds the backward's cost: no figure rather than 0.
        row["bwd_ms"] = difference if difference > 0 else None
        row["bwd_method"] = BWD_DIFFERENCE
    del out
    _clear_grads(inputs)
    return row


def _graph_times(attend: Callable, inputs: AttentionInputs, device: torch.device, iters: int,
                 warmup: int) -> tuple[dict[str, object], Optional[str]]:
    """fwd_graph_ms and fwdbwd_graph_ms (each pass captured once in a CUDA graph, its replay timed), and a note
    when a pass could not be captured."""
    q, k, v, leaves = inputs.q, inputs.k, inputs.v, inputs.leaves()
    row: dict[str, object] = {}
    note = None
    passes = {"fwd_graph_ms": lambda: attend(q, k, v),
              "fwdbwd_graph_ms": lambda: attend(q, k, v).backward(inputs.grad_out)}
    for key, run in passes.items():
        try:
            with graph_replay():
                replay = captured(run, device, grad_to_none=leaves)
        except RuntimeError as exc:  # e.g. a backend that synchronises with the host
            row[key] = None
            note = f"no CUDA graph: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            torch.cuda.synchronize(device)
            continue
        row[key] = time_ms(replay, device, iters=iters, warmup=warmup).median_ms
        del replay  # the graph and its memory pool
        _clear_grads(inputs)
    return row, note


def kernel_columns(name: str, inputs: AttentionInputs, point: AttentionPoint, graph_timing: bool
                   ) -> dict[str, object]:
    """fwd_kernel, bwd_kernel and kernel_reason of backends that choose between kernels (flash); empty otherwise.

    With graph_timing, the reason also gives the choice for launches replayed from a CUDA graph where it differs.
    """
    if name != "flash":
        return {}
    q, k, v, variant = inputs.q, inputs.k, inputs.v, variant_kwargs(point, inputs)
    choice = flash_kernels(q, k, v, point.causal, do=inputs.grad_out, replayed=False, **variant)
    reason = str(choice)
    if graph_timing:
        replayed = flash_kernels(q, k, v, point.causal, do=inputs.grad_out, replayed=True, **variant)
        if (replayed.forward, replayed.backward) != (choice.forward, choice.backward):
            reason += f" | replayed from a CUDA graph: {replayed}"
    return {"fwd_kernel": choice.forward, "bwd_kernel": choice.backward, "kernel_reason": reason}


def _attend(name: str, point: AttentionPoint, inputs: AttentionInputs) -> Callable:
    """attend(q, k, v): backend `name` on the point's mask and variants."""
    backend = get_attention(name)
    variant = variant_kwargs(point, inputs)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return backend(q, k, v, causal=point.causal, **variant)

    return attend


def tflops_columns(row: dict[str, object], point: AttentionPoint, inputs: AttentionInputs) -> dict[str, object]:
    """fwd_tflops, bwd_tflops and fwdbwd_tflops of a row's times."""
    return {f"{p}_tflops": tflops(point.flop(p, inputs.pairs), row.get(f"{p}_ms")) for p in ("fwd", "bwd", "fwdbwd")}


def time_again(name: str, point: AttentionPoint, inputs: AttentionInputs, device: torch.device | str, *,
               iters: int, warmup: int, graph_timing: bool = False) -> dict[str, object]:
    """Another round of measure_backend's timings of a backend it measured at `point`: the TIME_COLUMNS it
    fills. Raises what the backend raises."""
    device = torch.device(device)
    train = run_mode(name, inputs, point)[0] == "train"
    attend = _attend(name, point, inputs)
    row = _times(attend, inputs, point, device, iters, warmup, train)
    if graph_timing and train:
        row.update(_graph_times(attend, inputs, device, iters, warmup)[0])
        _clear_grads(inputs)
    return {key: row.get(key) for key in TIME_COLUMNS}


def measure_backend(name: str, point: AttentionPoint, inputs: AttentionInputs, ref: Optional[Reference],
                    device: torch.device | str, *, iters: int, warmup: int, time_passes: bool = True,
                    graph_timing: bool = False) -> Measurement:
    """Figures for backend `name` at `point` (status 'ok'), or status 'unsupported' with the reason.

    Raises what the backend raises (the caller turns OOM into a row); `ref` None skips the error columns.
    """
    device = torch.device(device)
    mode, reason = run_mode(name, inputs, point)
    if mode is None:
        return Measurement({"status": "unsupported", "note": reason}, None)
    train = mode == "train"
    attend = _attend(name, point, inputs)

    # Warm-up: compilation and autotuning must not land in the measured memory or times.
    if train:
        attend(inputs.q, inputs.k, inputs.v).backward(inputs.grad_out)
        _clear_grads(inputs)
    else:
        with torch.no_grad():
            attend(*(t.detach() for t in inputs.leaves()))

    measured = _memory_and_correctness(attend, inputs, point, ref, device, train)
    row: dict[str, object] = {"status": "ok", "note": None if train else f"forward only: {reason}"}
    row.update(kernel_columns(name, inputs, point, graph_timing and train))
    row.update(measured.row)
    if time_passes:
        # Memory and errors above stay in the row if only the repeated timing calls run out of memory.
        timed = call_catching_oom(lambda: _times(attend, inputs, point, device, iters, warmup, train))
        if timed.oom:
            _clear_grads(inputs)
            row.update(status=OOM_STATUS, note=f"while timing: {timed.message}")
            return Measurement(row, measured.saved)
        row.update(timed.value)
        row.update(tflops_columns(row, point, inputs))
        if graph_timing and train:
            graphed = call_catching_oom(lambda: _graph_times(attend, inputs, device, iters, warmup))
            _clear_grads(inputs)
            times, note = ({}, f"while timing CUDA graphs: {graphed.message}") if graphed.oom else graphed.value
            row.update(times)
            row["note"] = "; ".join(filter(None, [row["note"], note])) or None
    return Measurement(row, measured.saved)
