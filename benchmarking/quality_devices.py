"""Time to quality with the recipes side by side: one process per device, each taking the next recipe from a queue.

`bench_model.py --mode time-to-quality --devices cuda:0,cuda:1,...` trains as many recipes at once as devices are
given, each alone on its device (identical GPUs of one host: the clocks compare as on one GPU). Each process sees
only its GPU (CUDA_VISIBLE_DEVICES is set before it starts), so kernels, compiled code and CUDA graphs are built for
"cuda" as in a one-GPU run. The outcomes come back in the order of the plan; a stop asks every process to stop and
keeps what each measured.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import queue
import signal
from typing import Any

from benchmarking.quality import Outcome, QualitySettings, Say, open_data, run_one, with_device

STOP_WAIT_S = 60.0  # for the processes to report after a stop, before they are killed


def visible_gpu(device: str) -> str:
    """The CUDA_VISIBLE_DEVICES entry of "cuda:N", within the GPUs this process sees."""
    index = int(device.split(":")[1])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def side_by_side(settings: QualitySettings, planned: dict[tuple[str, str], tuple[Any, frozenset]], say: Say,
                 outcomes: list[Outcome]) -> None:
    """Train every planned (size, recipe) on settings.devices, several at once; appends the outcomes in plan order
    (on a KeyboardInterrupt too, then re-raised)."""
    ctx = multiprocessing.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    items = list(planned.items())
    for task in enumerate(items):
        tasks.put(task)
    workers = [start(ctx, device, settings, tasks, results) for device in settings.devices]
    for _ in workers:
        tasks.put(None)
    got: dict[int, Outcome] = {}
    try:
        collect(results, workers, got, len(items), say)
    except KeyboardInterrupt:
        for w in workers:
            if w.is_alive():
                os.kill(w.pid, signal.SIGINT)
        collect(results, workers, got, len(items), say, timeout_s=STOP_WAIT_S)
        raise
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
            w.join()
        outcomes.extend(got[i] for i in sorted(got))


def start(ctx: Any, device: str, settings: QualitySettings, tasks: Any, results: Any) -> Any:
    """A process for `device`, started with only that GPU visible."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpu(device)
    try:
        process = ctx.Process(target=work, args=(device, settings, tasks, results), daemon=True)
        process.start()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    return process


def collect(results: Any, workers: list, got: dict[int, Outcome], n: int, say: Say,
            timeout_s: float | None = None) -> None:
    """The processes' lines (said) and outcomes (into `got`) until there are `n`, every process has ended, or
    `timeout_s` passed without a message."""
    while len(got) < n:
        try:
            kind, payload = results.get(timeout=timeout_s or 1.0)
        except queue.Empty:
            if timeout_s is not None or not any(w.is_alive() for w in workers):
                return
            continue
        if kind == "say":
            say(payload)
        else:
            index, outcome = payload
            got[index] = outcome


def work(device: str, settings: QualitySettings, tasks: Any, results: Any) -> None:
    """One device's process: the recipes it takes from `tasks`, each run_one'd, each outcome sent back."""
    say = lambda line: results.put(("say", f"[{device}] {line}"))  # noqa: E731
    local = "cuda" if device.startswith("cuda") else device  # the one GPU this process sees
    sources = {}
    try:
        while (task := tasks.get()) is not None:
            index, ((size, spec), (config, explicit)) = task
            length = config.model.context_length
            sources[length] = sources.get(length) or open_data(settings, length)
            done: list[Outcome] = []
            try:
                run_one(spec, size, (with_device(config, local), explicit), sources[length], settings, say, done)
            finally:  # a stop (SIGINT) still reports the evaluations so far
                if done:
                    outcome = done[-1]
                    if outcome.config is not None:  # named as the parent names the device
                        outcome = dataclasses.replace(outcome, config=with_device(outcome.config, device))
                    results.put(("outcome", (index, outcome)))
    except KeyboardInterrupt:
        return
