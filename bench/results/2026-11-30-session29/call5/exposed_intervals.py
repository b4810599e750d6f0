"""Where a profiled step's communication is exposed: each stretch of collective kernel time no compute kernel
overlaps, longest first, with the collective's kernel, its size in bytes where the trace records it, and the compute
kernels that ran just before and just after (what the step waited between).

    python bench/results/2026-11-30-session29/call5/exposed_intervals.py TRACE.json [N]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from kernel_mix import COLLECTIVES, device_events, interval, kind_of  # noqa: E402

events = device_events(Path(sys.argv[1]))
top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
start = min(e["ts"] for e in events)
compute = sorted((e for e in events if e.get("cat") == "kernel" and kind_of(e.get("name", "")) != COLLECTIVES), key=lambda e: e["ts"])
comm = [e for e in events if kind_of(e.get("name", "")) == COLLECTIVES]
stretches = []
for c in comm:
    lo, hi = interval(c)
    cursor = lo
    for k in compute:
        a, b = interval(k)
        if b <= cursor or a >= hi:
            continue
        if a > cursor:
            stretches.append((cursor, a, c))
        cursor = max(cursor, b)
        if cursor >= hi:
            break
    if cursor < hi:
        stretches.append((cursor, hi, c))


def near(t: float, before: bool) -> str:
    found = [k for k in compute if (interval(k)[1] <= t if before else interval(k)[0] >= t)]
    if not found:
        return "-"
    k = found[-1] if before else found[0]
    return f"{k['name'][:60]} ({(k['ts'] - start) / 1e3:.2f} ms)"


total = sum(b - a for a, b, _ in stretches)
print(f"{len(stretches)} exposed stretches, {total / 1e3:.2f} ms over a {(max(interval(e)[1] for e in events) - start) / 1e3:.1f} ms span")
for a, b, c in sorted(stretches, key=lambda s: s[0] - s[1])[:top]:
    args = c.get("args", {})
    size = args.get("In msg nelems") or args.get("Out msg nelems") or ""
    print(f"{(a - start) / 1e3:8.2f} ms +{(b - a) / 1e3:.3f} ms  {c['name'][:50]} stream {args.get('stream', c.get('tid'))} "
          f"{'nelems ' + str(size) if size else ''}\n      after {near(a, True)}\n      before {near(b, False)}")
