"""Where a profiled step's compute stream sits idle, from its Chrome trace: kernel_mix.py says how long no compute
kernel ran and how much of that a collective covers; this says what the rest was. Each gap between compute kernels
is split into the part a collective ran in, the part only a copy ran in (symmetric memory's peer-to-peer copies
are copies, not collectives), and the part no device event ran in at all; that last part is cut at the moment the
host launched the kernel that ends the gap: before it the device waited for the host (launch-bound), after it for
a stream dependency (an event on another stream, a copy engine, a peer's signal).

    python bench/idle_gaps.py TRACE.json [--steps N] [--top N]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from kernel_mix import COLLECTIVES, interval, kind_of

_LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}
_NAME = 70


def _short(name: str) -> str:
    return name if len(name) <= _NAME else name[:_NAME - 3] + "..."


def _holes(busy: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of (lo, hi) that no interval of `busy` covers, first to last."""
    holes, at = [], lo
    for start, stop in sorted(busy):
        if start > at:
            holes.append((at, min(start, hi)))
        at = max(at, stop)
        if at >= hi:
            break
    if at < hi:
        holes.append((at, hi))
    return [(a, b) for a, b in holes if b > a]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def idle_gaps(events: list[dict], steps: int = 1, top: int = 8) -> dict:
    """ms per step of the compute stream's idle time by cause (`collective`, `copy`, `launch-bound`, `waiting`), and
    the `top` gaps of the last two causes, keyed by the kernels before and after them."""
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") in _LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in {"kernel", "gpu_memcpy", "gpu_memset"}]
    compute = sorted((e for e in device if e["cat"] == "kernel" and kind_of(e.get("name", "")) != COLLECTIVES),
                     key=lambda e: e["ts"])
    comm = [interval(e) for e in device if kind_of(e.get("name", "")) == COLLECTIVES]
    copies = [interval(e) for e in device if e["cat"] != "kernel"]
    totals: dict[str, float] = defaultdict(float)
    by_pair: dict[str, dict[tuple[str, str], float]] = {"launch-bound": defaultdict(float), "waiting": defaultdict(float)}
    ends = sorted(compute, key=lambda e: interval(e)[1])
    if not compute:
        return {"idle_ms": {}, "top": {cause: [] for cause in by_pair}}
    ei = ki = 0
    for a, b in _holes([interval(e) for e in compute], interval(compute[0])[0], max(interval(e)[1] for e in compute)):
        not_comm = _holes(comm, a, b)
        free = [h for lo, hi in not_comm for h in _holes(copies, lo, hi)]
        totals[COLLECTIVES] += (b - a) - _length(not_comm)
        totals["copy"] += _length(not_comm) - _length(free)
        while ki < len(compute) and compute[ki]["ts"] < b:
            ki += 1
        while ei + 1 < len(ends) and interval(ends[ei + 1])[1] <= a:
            ei += 1
        after, before = compute[ki], ends[ei]
        launched = launch.get(after.get("args", {}).get("correlation"), a)
        host = _length([(lo, min(hi, launched)) for lo, hi in free if lo < launched])
        pair = (_short(before.get("name", "?")), _short(after.get("name", "?")))
        for cause, us in (("launch-bound", host), ("waiting", _length(free) - host)):
            if us > 0:
                totals[cause] += us
                by_pair[cause][pair] += us
    ms = 1e3 * steps
    return {"idle_ms": {k: v / ms for k, v in totals.items()},
            "top": {cause: [(before, after, us / ms) for (before, after), us in sorted(pairs.items(), key=lambda kv: -kv[1])[:top]]
                    for cause, pairs in by_pair.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--top", type=int, default=8)
    a = parser.parse_args()
    found = idle_gaps(json.loads(a.trace.read_text()).get("traceEvents", []), a.steps, a.top)
    for cause, value in found["idle_ms"].items():
        print(f"{value:10.2f} ms  idle: {cause}")
    for cause, rows in found["top"].items():
        print(f"\n{cause}, by the kernels before and after the gap:")
        for before, after, value in rows:
            print(f"{value:10.2f} ms  {before}  ->  {after}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
