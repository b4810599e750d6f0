"""Kernel time of one profiled step by kind of kernel, from a Chrome trace: the same reading for
graph-trainer's trace (`<dump>/profile/trace.json`) and torchtitan's (`profile_traces/iteration_N/
rank0_trace.json`), so two trainers' steps can be compared kind by kind where their top-kernel lists,
named by different compilers, cannot.

    python bench/kernel_mix.py TRACE.json [--steps N]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

# first match wins: Inductor's templates (FlexAttention, and its GEMM templates when autotuned in) before its
# other Triton kernels, attention before GEMMs (attention kernels run matmuls too)
KINDS = [
    ("collectives", re.compile(r"nccl", re.I)),
    ("attention (cuDNN / flash)", re.compile(r"cudnn|sdpa|flash|fmha", re.I)),
    ("Triton templates", re.compile(r"^triton_tem")),
    ("Triton (Inductor)", re.compile(r"^triton_")),
    ("GEMM", re.compile(r"nvjet|gemm|cutlass|xmma|cublas|gemv", re.I)),
    ("optimizer (multi-tensor)", re.compile(r"multi_tensor_apply")),
    ("memcpy / memset", re.compile(r"^Mem(cpy|set)")),
    ("ATen (elementwise, reductions, indexing)", re.compile(r"at::native|at_cuda_detail|cub::")),
]
OTHER = "other"
_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), OTHER)


def kernel_mix(trace: Path, steps: int = 1) -> dict[str, float]:
    """ms per step of device time by kind (the trace's device events over `steps` profiled steps)."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    ms: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATEGORIES:
            ms[kind_of(e.get("name", ""))] += e.get("dur", 0.0) / 1e3 / steps
    return dict(sorted(ms.items(), key=lambda kv: -kv[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=1)
    a = parser.parse_args()
    for kind, ms in kernel_mix(a.trace, a.steps).items():
        print(f"{ms:10.2f} ms  {kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
