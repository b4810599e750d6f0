"""A short profiler window over a few training steps, and what it says about the step.

With `--profiling.enable`, the steps `profile_start_step .. profile_start_step + profile_steps - 1`
run under `torch.profiler`; rank 0 writes `<dump_folder>/profile/trace.json` (Chrome trace) and
`<dump_folder>/profile/summary.json`:
- `step_time_ms`: wall time per profiled step;
- `busy_ms`: time per step some kernel ran (on the GPU: the union of kernel intervals);
- `comm_ms` / `exposed_comm_ms`: time per step a collective ran, and the part of it no compute kernel
  overlapped; `exposed_comm_share` is the latter over the step time;
- `kernel_ms`: the summed time of all kernels per step;
- `top_kernels`: the kernels (GPU) or operators (CPU) that took the most time, with their share of
  `kernel_ms` (the profiler slows the host side of a step, not the kernels, so shares of kernel time
  hold for unprofiled steps; shares of the profiled wall time would not).
On the CPU the "kernels" are ATen operators (self time) and collectives are gloo's `c10d::` ops, which
run on their own threads, so overlap there is only indicative. Profiled steps are slower than the
others: their metrics records carry `"profiled": true` so throughput figures can leave them out.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

TOP_KERNELS = 15
# NCCL kernels on the GPU; on the CPU the functional collectives, their waits and gloo's own ops.
_COMM_MARKERS = ("nccl", "c10d::", "gloo", "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "alltoall", "wait_tensor")


def is_collective(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in _COMM_MARKERS)


def union_length(intervals: list[tuple[float, float]]) -> float:
    return sum(stop - start for start, stop in _merge(intervals))


def uncovered_length(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the union of `intervals` that no interval of `cover` overlaps."""
    return union_length(intervals) - union_length(_intersections(intervals, cover))


def _intersections(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged_b = _merge(b)
    out = []
    for start, stop in a:
        for b_start, b_stop in merged_b:
            if b_start >= stop:
                break
            lo, hi = max(start, b_start), min(stop, b_stop)
            if lo < hi:
                out.append((lo, hi))
    return out


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, stop in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [(s, e) for s, e in merged]


def summarize_events(events: list[Any], steps: int, wall_s: float, device_type: str) -> dict[str, Any]:
    """Per-step figures from profiler events (`FunctionEvent`s; times in microseconds)."""
    on_device = device_type == "cuda"
    kernels = [e for e in events if (e.device_type == DeviceType.CUDA) == on_device]
    if not on_device:
        # Only operators called from Python or the graph, not the ops they call, so times do not double.
        kernels = [e for e in kernels if e.cpu_parent is None]
    comm = [(e.time_range.start, e.time_range.end) for e in kernels if is_collective(e.name)]
    compute = [(e.time_range.start, e.time_range.end) for e in kernels if not is_collective(e.name)]
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        totals[e.name][0] += 1
        totals[e.name][1] += e.time_range.elapsed_us()
    step_ms = 1e3 * wall_s / steps
    busy_ms = union_length(comm + compute) / 1e3 / steps
    exposed_ms = uncovered_length(comm, compute) / 1e3 / steps
    top = sorted(totals.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    kernel_us = sum(us for _, us in totals.values())
    return {
        "device": device_type,
        "steps": steps,
        "step_time_ms": step_ms,
        "busy_ms": busy_ms,
        "comm_ms": union_length(comm) / 1e3 / steps,
        "exposed_comm_ms": exposed_ms,
        "exposed_comm_share": exposed_ms / step_ms if step_ms else 0.0,
        "kernel_ms": kernel_us / 1e3 / steps,
        "top_kernels": [
            {"name": name, "count": count // steps, "ms_per_step": us / 1e3 / steps, "share_of_kernel_time": us / kernel_us}
            for name, (count, us) in top
        ],
    }


class StepProfiler:
    """Starts the profiler before the first profiled step and stops it after the last one."""

    def __init__(self, dump_folder: str, start_step: int, steps: int, device: torch.device, is_rank0: bool, enabled: bool):
        self.folder = Path(dump_folder) / "profile"
        self.first, self.last = start_step, start_step + steps - 1
        self.device = device
        self.is_rank0 = is_rank0
        self.enabled = enabled
        self.prof: profile | None = None
        self.started_at = 0.0

    def covers(self, step: int) -> bool:
        return self.enabled and self.first <= step <= self.last

    def before_step(self, step: int) -> None:
        if not (self.enabled and step == self.first):
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._sync()
        self.prof = profile(activities=activities)
        self.prof.__enter__()
        self.started_at = time.perf_counter()

    def after_step(self, step: int) -> None:
        if self.prof is None or step != self.last:
            return
        self._sync()
        wall = time.perf_counter() - self.started_at
        self.prof.__exit__(None, None, None)
        if self.is_rank0:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.folder / "trace.json"))
            summary = summarize_events(list(self.prof.events()), self.last - self.first + 1, wall, self.device.type)
            (self.folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.prof = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
