"""Each NCCL kernel of call 3's profiled step (rank 0's trace): its operation, message sizes, dtype, kernel time and the
bytes a rank sends to its peer over the time (all-to-all, all-gather, reduce-scatter of 2 ranks: half the buffer),
and for each all-to-all how much of its time another NCCL kernel or a compute kernel ran beside it.

    python bench/results/2026-11-30-session23/call3/collectives.py trace.json.gz
"""

import gzip
import json
import sys

ITEMSIZE = {"BFloat16": 2, "Float": 4, "Long": 8}


def overlap(a: dict, b: dict) -> float:
    return max(0.0, min(a["ts"] + a["dur"], b["ts"] + b["dur"]) - max(a["ts"], b["ts"]))


kernels = [e for e in json.load(gzip.open(sys.argv[1]))["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]
nccl = sorted((e for e in kernels if "ncclDevKernel" in e["name"]), key=lambda e: e["ts"])
compute = [e for e in kernels if "ncclDevKernel" not in e["name"]]
print("| operation | in elements | out elements | dtype | kernel us | sent GB/s | beside other NCCL us | beside compute us |")
print("|---|---|---|---|---|---|---|---|")
for e in nccl:
    a = e["args"]
    size = ITEMSIZE.get(a.get("dtype"), 2)
    moved = (a["In msg nelems"] if "ReduceScatter" in e["name"] else a["Out msg nelems"]) * size
    sent = moved / 2 if a.get("Group size") == 2 and "AllReduce" not in e["name"] else moved
    beside = sum(overlap(e, o) for o in nccl if o is not e) if "SendRecv" in e["name"] else None
    busy = sum(overlap(e, c) for c in compute) if "SendRecv" in e["name"] else None
    print(f"| {a.get('Collective name')} | {a['In msg nelems']:,} | {a['Out msg nelems']:,} | {a.get('dtype')} | {e['dur']:.1f} | "
          f"{sent / e['dur'] / 1e3:.1f} | {'-' if beside is None else f'{beside:.1f}'} | {'-' if busy is None else f'{busy:.1f}'} |")
