"""Kernel time of one profiled step by kind of kernel, and its exposed communication, from a Chrome trace: the same
reading for graph-trainer's trace (`<dump>/profile/trace.json`) and torchtitan's (`profile_traces/iteration_N/
rank0_trace.json`), so two trainers' steps can be compared kind by kind where their top-kernel lists, named by
different compilers, cannot.

    python bench/kernel_mix.py TRACE.json [--steps N]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from graph_trainer.profiling import union_length, uncovered_length

# first match wins: Inductor's templates (FlexAttention, and its GEMM templates when autotuned in) before its
# other Triton kernels, attention before GEMMs (attention kernels run matmuls too)
KINDS = [
    # symmetric memory's barriers (async TP's fused ops) spin until the peer arrives: waiting on communication
    ("collectives", re.compile(r"nccl|symmetric_memory::", re.I)),
    ("attention (cuDNN / flash)", re.compile(r"cudnn|sdpa|flash|fmha", re.I)),
    ("Triton templates", re.compile(r"^triton_tem")),
    ("Triton (Inductor)", re.compile(r"^triton_")),
    ("GEMM", re.compile(r"nvjet|gemm|cutlass|xmma|cublas|gemv", re.I)),
    ("optimizer (multi-tensor)", re.compile(r"multi_tensor_apply")),
    ("memcpy / memset", re.compile(r"^Mem(cpy|set)")),
    ("ATen (elementwise, reductions, indexing)", re.compile(r"at::native|at_cuda_detail|cub::")),
]
OTHER = "other"
COLLECTIVES = KINDS[0][0]
_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), OTHER)


def device_events(trace: Path) -> list[dict]:
    """The trace's complete events that ran on the device (kernels, copies, memsets); times in microseconds."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATEGORIES]


def kernel_mix(events: list[dict], steps: int = 1) -> dict[str, float]:
    """ms per step of device time by kind, over `steps` profiled steps."""
    ms: dict[str, float] = defaultdict(float)
    for e in events:
        ms[kind_of(e.get("name", ""))] += e.get("dur", 0.0) / 1e3 / steps
    return dict(sorted(ms.items(), key=lambda kv: -kv[1]))


def interval(e: dict) -> tuple[float, float]:
    return e["ts"], e["ts"] + e.get("dur", 0.0)


_OP = re.compile(r"ncclDevKernel_([A-Za-z]+)|symmetric_memory::(\w+?)_kernel")


def exposed_by_collective(events: list[dict], compute: list[tuple[float, float]], steps: int = 1) -> dict[str, float]:
    """ms per step of each collective's exposed time (NCCL's kernel name: AllGather, ReduceScatter, AllReduce,
    SendRecv, ...; `symm_mem barrier` for symmetric memory's): where the exposed part of the step comes from."""
    by_op: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if op := _OP.search(e.get("name", "")):
            by_op[op.group(1) or f"symm_mem {op.group(2)}"].append(interval(e))
    return {op: uncovered_length(spans, compute) / 1e3 / steps for op, spans in sorted(by_op.items())}


SPAN_PARTS = 10


def exposed_by_part(comm: list[tuple[float, float]], compute: list[tuple[float, float]], start: float, span: float,
                    steps: int = 1) -> list[float]:
    """ms per step of exposed communication in each tenth of the kernel span, first to last: communication left
    exposed at the ends (the first blocks' gathers, the last gradients' reductions, which nothing can hide) against
    communication exposed all through the step (a schedule that waits too early, or links slower than planned)."""
    parts = []
    for i in range(SPAN_PARTS):
        lo, hi = start + span * i / SPAN_PARTS, start + span * (i + 1) / SPAN_PARTS
        clipped = [(max(a, lo), min(b, hi)) for a, b in comm if b > lo and a < hi]
        parts.append(uncovered_length(clipped, compute) / 1e3 / steps)
    return parts


def exposed_comm(events: list[dict], steps: int = 1) -> dict[str, float]:
    """Per step: the kernel span (first device event's start to the last one's end), the time some collective kernel
    ran, and the part of it no compute kernel overlapped; `exposed_comm_share` is that part over the span. Kernels of
    one stream run one after another, so a compute kernel that overlaps a collective ran on another stream; copies
    and memsets are no compute. `compute_idle_share`: the part of the span no compute kernel ran, a pipeline's
    bubble (a stage waiting on its neighbour) plus its exposed communication; `exposed_by_collective_ms`, the exposed
    part by NCCL operation; `exposed_by_part_ms`, by tenth of the span (`exposed_by_part`). Empty without device
    events (a CPU trace)."""
    if not events:
        return {}
    comm = [interval(e) for e in events if kind_of(e.get("name", "")) == COLLECTIVES]
    compute = [interval(e) for e in events if e.get("cat") == "kernel" and kind_of(e.get("name", "")) != COLLECTIVES]
    first = min(start for start, _ in map(interval, events))
    span_us = max(stop for _, stop in map(interval, events)) - first
    exposed_us = uncovered_length(comm, compute)
    idle_us = span_us - union_length(compute)
    return {"kernel_span_ms": span_us / 1e3 / steps, "comm_ms": union_length(comm) / 1e3 / steps,
            "exposed_comm_ms": exposed_us / 1e3 / steps, "exposed_comm_share": exposed_us / span_us if span_us else 0.0,
            "compute_idle_ms": idle_us / 1e3 / steps, "compute_idle_share": idle_us / span_us if span_us else 0.0,
            "exposed_by_collective_ms": exposed_by_collective(events, compute, steps),
            "exposed_by_part_ms": exposed_by_part(comm, compute, first, span_us, steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=1)
    a = parser.parse_args()
    events = device_events(a.trace)
    for kind, ms in kernel_mix(events, a.steps).items():
        print(f"{ms:10.2f} ms  {kind}")
    for name, value in exposed_comm(events, a.steps).items():
        if isinstance(value, dict):
            print(f"{'':10}     {name}: " + ", ".join(f"{op} {ms:.3f}" for op, ms in value.items()))
        elif isinstance(value, list):
            print(f"{'':10}     {name}: " + " ".join(f"{ms:.1f}" for ms in value))
        else:
            print(f"{value:10.3f}     {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
