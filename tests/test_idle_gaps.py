"""bench/idle_gaps.py: what a profiled step's compute stream waited for while it sat idle, from the Chrome trace."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from idle_gaps import idle_gaps  # noqa: E402


def _kernel(name: str, ts: float, dur: float, correlation: int, tid: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {"correlation": correlation}}


def _launch(ts: float, correlation: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5.0, "args": {"correlation": correlation}}


def test_idle_time_by_cause():
    """Compute kernels at 0-100, 500-600 and 700-800 us. The first gap (100-500): an all-gather runs 100-150, a
    peer-to-peer copy 150-200, nothing 200-500; the kernel after it was launched by the host at 350, so 200-350 waited
    for the host and 350-500 for something else. The second gap (600-700): the kernel after it was launched at 50,
    long before, so all of it waited. A collective that overlaps compute (0-50) is no idle time."""
    events = [
        _kernel("nvjet_a", 0.0, 100.0, 1), _launch(0.0, 1),
        _kernel("ncclDevKernel_AllGather_RING_LL", 100.0, 50.0, 2, tid=20),
        _kernel("ncclDevKernel_AllReduce_RING_LL", 0.0, 50.0, 5, tid=20),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)", "ts": 150.0, "dur": 50.0, "tid": 21},
        _kernel("triton_poi_b", 500.0, 100.0, 3), _launch(350.0, 3),
        _kernel("nvjet_c", 700.0, 100.0, 4), _launch(50.0, 4),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 900.0},
    ]
    found = idle_gaps(events, steps=1)
    assert found["idle_ms"] == pytest.approx({"collectives": 0.05, "copy": 0.05, "launch-bound": 0.15, "waiting": 0.25})
    assert found["top"]["launch-bound"] == [("nvjet_a", "triton_poi_b", pytest.approx(0.15))]
    assert found["top"]["waiting"] == [("nvjet_a", "triton_poi_b", pytest.approx(0.15)), ("triton_poi_b", "nvjet_c", pytest.approx(0.1))]


def test_no_compute_kernels():
    assert idle_gaps([_launch(0.0, 1)]) == {"idle_ms": {}, "top": {"launch-bound": [], "waiting": []}}
