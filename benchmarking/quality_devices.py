"""Time to quality with the recipes side by side: one process per device, each taking the next recipe from a queue.

`bench_model.py --mode time-to-quality --devices cuda:0,cuda:1,...` trains as many recipes at once as devices are
given, each alone on its device (identical GPUs of one host: the clocks compare as on one GPU). Each process sees
only its GPU (CUDA_VISIBLE_DEVICES is set before it starts), so kernels, compiled code and CUDA graphs are built for
"cuda" as in a one-GPU run. The outcomes come back in the order of the plan. A stop (Ctrl-C, or SIGTERM to the
benchmark or to its whole process group) stops every process, and each reports the evaluations it had; a process
that dies, or a recipe that raises, becomes an `error` row naming it, and the others go on.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import queue
import signal
import time
from typing import Any, Optional

from benchmarking.quality import Outcome, QualitySettings, Say, open_data, recipe_label, run_one

STOP_WAIT_S = 60.0  # at most, for the processes to report after a stop, before they are killed


def visible_gpu(device: str) -> str:
    """The CUDA_VISIBLE_DEVICES entry of "cuda:N", within the GPUs this process sees."""
    index = int(device.split(":")[1])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


@dataclasses.dataclass
class Progress:
    """What the parent knows: which process took each recipe, and the outcomes reported."""

    items: list  # [((size, spec), (config, explicit))], the plan
    taken: dict[int, int] = dataclasses.field(default_factory=dict)  # recipe index -> process index
    got: dict[int, Outcome] = dataclasses.field(default_factory=dict)

    def lost(self, workers: list, interrupted: bool) -> dict[int, Outcome]:
        """Error rows for the recipes no outcome came back for: taken by a process that ended, or (unless stopped)
        not known to be taken when every process had ended."""
        rows = {}
        for index, ((size, spec), (config, _)) in enumerate(self.items):
            if index in self.got:
                continue
            if index in self.taken:
                process = workers[self.taken[index]]
                message = f"its process ({process.name}) ended with exit code {process.exitcode} while training it"
            elif interrupted:
                continue
            else:  # never taken, or taken by a process that ended before it could say so
                codes = ", ".join(f"{w.name}: exit code {w.exitcode}" for w in workers)
                message = f"no outcome came back: the processes ended ({codes})"
            rows[index] = Outcome(size, recipe_label(spec), config, [], status="error", message=message)
        return rows


def side_by_side(settings: QualitySettings, planned: dict[tuple[str, str], tuple[Any, frozenset]], say: Say,
                 outcomes: list[Outcome]) -> None:
    """Train every planned (size, recipe) on settings.devices, several at once; appends the outcomes in plan order
    (on a KeyboardInterrupt too, then re-raised)."""
    ctx = multiprocessing.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    progress = Progress(list(planned.items()))
    for task in enumerate(progress.items):
        tasks.put(task)
    workers = [start(ctx, i, device, settings, tasks, results) for i, device in enumerate(settings.devices)]
    for _ in workers:
        tasks.put(None)
    interrupted = False
    try:
        collect(results, workers, progress, say)
    except KeyboardInterrupt:
        interrupted = True
        for w in workers:
            if w.is_alive():
                os.kill(w.pid, signal.SIGINT)  # a process that had the signal already ignores this one
        collect(results, workers, progress, say, deadline=time.monotonic() + STOP_WAIT_S)
        raise
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
            w.join()
        tasks.cancel_join_thread()  # recipes left in the queue must not hold the exit
        found = {**progress.got, **progress.lost(workers, interrupted)}
        outcomes.extend(found[i] for i in sorted(found))


def start(ctx: Any, index: int, device: str, settings: QualitySettings, tasks: Any, results: Any) -> Any:
    """Process `index`, for `device`, started with only that GPU visible."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpu(device)
    try:
        process = ctx.Process(target=work, args=(index, device, settings, tasks, results), daemon=True,
                              name=f"{device} #{index}")
        process.start()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    return process


def collect(results: Any, workers: list, progress: Progress, say: Say, deadline: Optional[float] = None) -> None:
    """The processes' messages until every recipe has its outcome, no process is left, or `deadline` passes."""
    while len(progress.got) < len(progress.items):
        try:
            kind, payload = results.get(timeout=1.0)
        except queue.Empty:
            if not any(w.is_alive() for w in workers) or (deadline is not None and time.monotonic() > deadline):
                return
            continue
        if kind == "say":
            say(payload)
        elif kind == "taken":
            index, worker = payload
            progress.taken[index] = worker
        else:
            index, outcome = payload
            progress.got[index] = outcome


def stop_once(signum: int, frame: Any) -> None:
    """The first SIGINT or SIGTERM stops the process's recipe (KeyboardInterrupt); later ones are ignored, so that
    the stop, which reports the recipe's evaluations, is not itself cut short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def work(index: int, device: str, settings: QualitySettings, tasks: Any, results: Any) -> None:
    """Process `index`: the recipes it takes from `tasks`, each run_one'd on `device`, each outcome sent back."""
    signal.signal(signal.SIGINT, stop_once)
    signal.signal(signal.SIGTERM, stop_once)
    say = lambda line: results.put(("say", f"[{device}] {line}"))  # noqa: E731
    sources = {}
    try:
        while (task := tasks.get()) is not None:
            recipe, ((size, spec), (config, explicit)) = task
            results.put(("taken", (recipe, index)))
            length = config.model.context_length
            done: list[Outcome] = []
            try:
                sources[length] = sources.get(length) or open_data(settings, length)
                local = config.replace(execution={"device": "cuda" if device.startswith("cuda") else device})  # its GPU
                run_one(spec, size, (local, explicit), sources[length], settings, say, done)
            except Exception as e:  # noqa: BLE001  # what run_one lets through: the row says it, the others go on
                message = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                done[-1:] = [dataclasses.replace(done[-1] if done else Outcome(size, recipe_label(spec), config, []),
                                                 status="error", message=message)]
            finally:  # a stop (KeyboardInterrupt) still reports the evaluations so far
                if done:
                    outcome = done[-1]
                    if outcome.config is not None:  # named as the parent names the device
                        named = outcome.config.replace(execution={"device": device})
                        outcome = dataclasses.replace(outcome, config=named)
                    results.put(("outcome", (recipe, outcome)))
    except KeyboardInterrupt:
        return
