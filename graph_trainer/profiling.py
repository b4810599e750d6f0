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
With `--profiling.memory_snapshot` the same steps record the CUDA allocator's history; rank 0 writes
`memory_snapshot.pickle` (pytorch.org/memory_viz) and `memory_peak.json`: the most bytes allocated at once, what
was allocated before the recording started, and the blocks live at that peak grouped by the line that allocated
them (`at_peak`, largest first: a compiled graph's `empty_strided_cuda` line with the graph nodes Inductor's comment
above it names).
On the CPU the "kernels" are ATen operators (self time) and collectives are gloo's `c10d::` ops, which
run on their own threads, so overlap there is only indicative. Profiled steps are slower than the
others: their metrics records carry `"profiled": true` so throughput figures can leave them out.
"""

from __future__ import annotations

import json
import linecache
import pickle
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

TOP_KERNELS = 15
STEP_RANGE = "ProfilerStep"
"""The range the profiler's schedule opens around each step."""
AT_PEAK_LINES = 30
_OWN_FRAMES = ("torchinductor", "graph_trainer")
"""Where a block's allocating line is looked for, innermost frame first: a compiled graph's module, then ours."""
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
    kernels = [e for e in events if (e.device_type == DeviceType.CUDA) == on_device and not e.name.startswith(STEP_RANGE)]
    if not on_device:
        # Only operators called from Python or the graph, not the ops they call, so times do not double.
        kernels = [e for e in kernels if e.cpu_parent is None or e.cpu_parent.name.startswith(STEP_RANGE)]
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


def _allocating_line(frames: list[dict]) -> tuple[str, str]:
    """(file:line, its source and the graph nodes it computes) of the innermost frame in a compiled graph or ours."""
    for f in frames:
        name, line = f["filename"], f["line"]
        if any(part in name for part in _OWN_FRAMES):
            code = linecache.getline(name, line).strip()
            for back in range(1, 4):
                previous = linecache.getline(name, line - back).strip()
                if previous.startswith("# Topologically Sorted Source Nodes"):
                    code = f"{code}  {previous}"
                    break
            return f"{name}:{line}", code
    top = frames[0] if frames else {"filename": "?", "line": 0}
    return f"{top['filename']}:{top['line']}", ""


def memory_at_peak(trace: list[dict], before: int) -> dict[str, Any]:
    """The peak of active bytes over an allocator trace (torch.cuda.memory._snapshot()'s device trace) that began with
    `before` bytes active (a block counts until its free completes, as the allocator's active figure counts it), and
    the blocks live there grouped by allocating line."""
    live: dict[int, dict] = {}
    current = peak = before
    peak_at = -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            current += event["size"]
            if current > peak:
                peak, peak_at = current, i
        elif event["action"] == "free_completed":
            current -= event["size"]
    for event in trace[: peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    lines: dict[str, list] = {}
    for event in live.values():
        where, code = _allocating_line(event.get("frames", []))
        entry = lines.setdefault(where, [0, 0, code])
        entry[0] += event["size"]
        entry[1] += 1
    top = sorted(lines.items(), key=lambda kv: -kv[1][0])[:AT_PEAK_LINES]
    at_peak = [{"where": where, "bytes": size, "blocks": count, "code": code} for where, (size, count, code) in top]
    return {"peak_bytes": peak, "before_recording_bytes": before, "at_peak": at_peak}


class StepProfiler:
    """Profiles steps `start_step` .. `start_step + steps - 1`, started a step earlier where there is one (a warm-up step
    whose events are dropped): starting the profiler takes each rank its own time, and a rank that started late held
    the others' first collective of the first profiled step, which their traces then showed as exposed."""

    def __init__(self, dump_folder: str, start_step: int, steps: int, device: torch.device, is_rank0: bool,
                 enabled: bool, memory_snapshot: bool = False):
        self.folder = Path(dump_folder) / "profile"
        self.first, self.last = start_step, start_step + steps - 1
        self.device = device
        self.is_rank0 = is_rank0
        self.enabled = enabled
        # only the rank that writes the snapshot records one: recording takes a Python stack at every allocation
        self.memory_snapshot = memory_snapshot and is_rank0
        self.prof: profile | None = None
        self.started_at = 0.0
        self.allocated_before = 0

    def covers(self, step: int) -> bool:
        return self.enabled and self.first <= step <= self.last

    def before_step(self, step: int) -> None:
        if self.memory_snapshot and step == self.first:
            self._sync()
            self.allocated_before = torch.cuda.memory_allocated(self.device)
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        warmup = int(self.first > 1)
        if not (self.enabled and step == self.first - warmup):
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._sync()
        self.prof = profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=self.last - self.first + 1))
        self.prof.__enter__()
        self.started_at = time.perf_counter()

    def after_step(self, step: int) -> None:
        if self.memory_snapshot and step == self.last:
            self._sync()
            snapshot = torch.cuda.memory._snapshot(self.device)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / "memory_snapshot.pickle").write_bytes(pickle.dumps(snapshot))
            summary = memory_at_peak(snapshot["device_traces"][self.device.index or 0], self.allocated_before)
            (self.folder / "memory_peak.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.prof is None:
            return
        if step != self.last:
            if step < self.first:
                # the warm-up step's kernels end before the first profiled step's clock starts
                self._sync()
                self.started_at = time.perf_counter()
            self.prof.step()
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
