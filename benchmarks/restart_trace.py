"""Time stamps of a vLLM engine's kvtier calls, for ``bench_vllm_restart.py``.

``install(path)`` wraps, in whichever process imports them, the connector's
scheduler and worker hooks, the manager's job submissions, the tiers' batch
moves and progress announcements, and ``LLM.generate``; each call appends
``monotonic_ns pid event detail`` lines to ``path`` (``O_APPEND``: whole lines
from every process). The modules are wrapped as they are imported, so that
nothing here imports vLLM before the engine does. ``summarise`` turns the
lines into one breakdown per prompt.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_fd: int | None = None


def record(event: str, detail: object = "") -> None:
    if _fd is not None:
        os.write(_fd, f"{time.monotonic_ns()} {os.getpid()} {event} {detail}\n".encode())


def _wrap(owner: Any, name: str, event: str, detail: Callable[..., object] | None = None) -> None:
    original = getattr(owner, name, None)
    if original is None:  # a tree without this call
        return

    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        record(f"{event}+", "")
        result = original(*args, **kwargs)
        record(f"{event}-", detail(args, result) if detail is not None else "")
        return result

    setattr(owner, name, traced)


def _lookup_answer(args: tuple[Any, ...], result: Any) -> object:
    return f"{args[1].request_id}:{result[0]}"


def _patch_scheduler(module: ModuleType) -> None:
    side = module.SchedulerSide
    _wrap(side, "get_num_new_matched_tokens", "lookup", _lookup_answer)
    _wrap(side, "_await_promotions", "idle-wait", lambda a, r: f"{r.hit_chunks}:{r.pending}")
    _wrap(side, "update_state_after_alloc", "alloc")
    _wrap(side, "build_connector_meta", "meta", lambda a, r: len(r.loads.block_ids))
    _wrap(side, "update_connector_output", "worker-report")


def _patch_worker(module: ModuleType) -> None:
    _wrap(module.WorkerSide, "start_load_kv", "worker-load", lambda a, r: len(a[1].loads.block_ids))


def _patch_jobs(module: ModuleType) -> None:
    book = module.JobBook
    original = book.submit

    @functools.wraps(original)
    def submit(self: Any, index: int, job: Any, *, loading: bool) -> None:
        if loading:
            record("submit-load", len(job.keys))
        original(self, index, job, loading=loading)

    book.submit = submit
    _wrap(book, "collect", "collect")


def _patch_runtime(module: ModuleType) -> None:
    tier = module.TierRuntime
    original = tier.move

    @functools.wraps(original)
    def move(self: Any, state: Any, keys: Sequence[Any], payloads: Sequence[Any]) -> Any:
        if not state.loading:
            return original(self, state, keys, payloads)
        record("read+", threading.get_ident())
        try:
            return original(self, state, keys, payloads)
        finally:
            record("read-", threading.get_ident())

    tier.move = move


def _patch_progress(module: ModuleType) -> None:
    _wrap(module.Progress, "announce", "announce")


def _patch_llm(module: ModuleType) -> None:
    _wrap(module.LLM, "generate", "generate")


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "kvtier.integrations.vllm.scheduler": _patch_scheduler,
    "kvtier.integrations.vllm.worker": _patch_worker,
    "kvtier.jobs": _patch_jobs,
    "kvtier.tiers.runtime": _patch_runtime,
    "kvtier.progress": _patch_progress,
    "vllm.entrypoints.llm": _patch_llm,
}


class _Patcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: runs a module's patch right after it executes."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install(path: str) -> None:
    global _fd
    _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.meta_path.insert(0, _Patcher())


def summarise(path: str) -> list[dict[str, float]]:
    """One breakdown per ``generate`` call, in ms from its start."""
    events: list[tuple[float, str, str]] = []
    with open(path) as f:
        for line in f:
            micros, _pid, name, *rest = line.split(" ", 3)
            events.append((int(micros) / 1e6, name, (rest[0] if rest else "").strip()))
    events.sort()
    prompts: list[dict[str, float]] = []
    start: float | None = None
    window: list[tuple[float, str, str]] = []
    for stamp, event, detail in events:
        if event == "generate+":
            start, window = stamp, []
        elif event == "generate-" and start is not None:
            prompts.append(_breakdown(start, stamp, window))
            start = None
        elif start is not None:
            window.append((stamp, event, detail))
    return prompts


def _breakdown(start: float, end: float, window: list[tuple[float, str, str]]) -> dict[str, float]:
    """ms from the prompt's start to each stage (NaN: none in this prompt)."""

    def first(
        event: str, after: float = -math.inf, where: Callable[[str], bool] = lambda d: True
    ) -> float:
        found = (t - start for t, e, d in window if e == event and t - start >= after and where(d))
        return next(found, math.nan)

    def last(event: str) -> float:
        return next((t - start for t, e, _ in reversed(window) if e == event), math.nan)

    last_read_end = last("read-")
    pages_copied = first("worker-load-", where=lambda d: d != "0")
    return {
        "ttft": end - start,
        "first_lookup": first("lookup+"),
        "submitted": first("submit-load"),
        "first_read": first("read+"),
        "last_read_start": last("read+"),
        "last_read_end": last_read_end,
        "reads": sum(1 for _, e, _ in window if e == "read+"),
        # The job's end, announced by the worker that read its last chunk.
        "announced": first("announce+", last_read_end),
        "answered": first("lookup-", where=lambda d: not d.endswith(":None")),
        "lookups": sum(1 for _, e, _ in window if e == "lookup+"),
        "loads_planned": first("meta-", where=lambda d: d != "0"),
        "pages_copied": pages_copied,
        # The worker's report of the step that copied the pages: vLLM's forward is in it.
        "step_reported": first("worker-report+", pages_copied),
    }


#: The stages of a prompt reported, as (label, from, to) fields of :func:`summarise`.
STAGES = [
    ("first lookup to promotion submitted", "first_lookup", "submitted"),
    ("submitted to the first read started", "submitted", "first_read"),
    ("reads: first start to last start", "first_read", "last_read_start"),
    ("reads: first start to last end", "first_read", "last_read_end"),
    ("last read's end to the lookup answering", "last_read_end", "answered"),
    ("promotion: first lookup to the answer", "first_lookup", "answered"),
    ("answer to vLLM's pages copied (worker)", "answered", "pages_copied"),
    ("pages copied to the step's report (forward)", "pages_copied", "step_reported"),
    ("time to first token", "", "ttft"),
]


def stage_lines(prompts: list[dict[str, float]]) -> list[str]:
    """ms per stage over ``prompts``: p50 (p10-p90) of those that have it."""
    lines = []
    for label, begin, end in STAGES:
        spans = [p.get(end, math.nan) - (p.get(begin, math.nan) if begin else 0.0) for p in prompts]
        spans = sorted(span for span in spans if not math.isnan(span))
        if spans:
            p10, p50, p90 = (
                spans[min(len(spans) - 1, int(q * len(spans)))] for q in (0.1, 0.5, 0.9)
            )
            lines.append(f"  {label}: {p50:.1f} ({p10:.1f}-{p90:.1f}), {len(spans)} prompts")
    return lines
