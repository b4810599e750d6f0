"""How far the host ran ahead of the device through a profiled step (the time from each kernel's launch to its start,
by 10 ms of the step), and the host ops that took longest, from the call's gzipped trace (not kept: 0.5 MB):

    python host_lead.py trace.json.gz
"""

import collections
import gzip
import json
import statistics
import sys

events = json.load(gzip.open(sys.argv[1]))["traceEvents"]
launch = {e["args"]["correlation"]: e["ts"] for e in events
          if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
start = kernels[0]["ts"]
lead = collections.defaultdict(list)
for k in kernels:
    if (t := launch.get(k["args"].get("correlation"))) is not None:
        lead[int((k["ts"] - start) // 10_000)].append(k["ts"] - t)
print("step ms  kernels  host ahead by, ms: least  median")
for window, leads in sorted(lead.items()):
    print(f"{window * 10:7d}  {len(leads):7d}  {min(leads) / 1e3:21.2f}  {statistics.median(leads) / 1e3:6.2f}")
ops = collections.defaultdict(lambda: [0, 0.0])
for e in events:
    if e.get("cat") == "cpu_op" and e.get("ph") == "X":
        ops[e["name"]][0] += 1
        ops[e["name"]][1] += e["dur"]
print("\nhost ops, total ms, calls")
for name, (count, us) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:15]:
    print(f"{us / 1e3:8.2f}  {count:5d}  {name[:90]}")
