"""The GEMM kernels of profiled steps, by kernel and grid, from gzipped Chrome traces (the call's traces did not stay:
0.3-0.5 MB each):

    python gemms.py RUN.trace.json.gz [...]
"""

import collections
import gzip
import json
import sys

for path in sys.argv[1:]:
    events = json.load(gzip.open(path))["traceEvents"]
    by_kernel: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "kernel" and "nvjet" in e["name"]:
            key = (e["name"].replace("nvjet_sm90_tst_", "")[:40], tuple(e["args"].get("grid", [])))
            by_kernel[key][0] += 1
            by_kernel[key][1] += e["dur"]
    print(f"== {path}: {sum(v[1] for v in by_kernel.values()) / 1e3:.1f} ms, {sum(v[0] for v in by_kernel.values())} kernels")
    for (name, grid), (count, us) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1]):
        print(f"{us / 1e3:8.2f} ms {count:5d}  {us / count:8.1f} us a call  {name} {grid}")
