"""bench/kernel_mix.py: kernel time of a profiled step by kind, and its exposed communication, from a Chrome trace, so
two trainers' steps (ours, torchtitan's) compare kind by kind. The names below are kernels seen in the H200 and H100
profiles."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from kernel_mix import device_events, exposed_comm, kernel_mix, kind_of  # noqa: E402


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "GEMM"),
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13Ge", "GEMM"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nt_n_tilesize32x64x8_stage3_warpsize1x2x1_ffma", "GEMM"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1", "attention (cuDNN / flash)"),
    ("triton_tem_fused_77", "Triton templates"),
    ("triton_poi_fused_add_clamp_max_convert_element_type_copy__div", "Triton (Inductor)"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous n", "optimizer (multi-tensor)"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native:", "ATen (elementwise, reductions, indexing)"),
    ("Memcpy DtoD (Device -> Device)", "memcpy / memset"),
    ("ncclDevKernel_AllGather_RING_LL", "collectives"),
    ("c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int, unsigned long)", "collectives"),
    ("some_vendor_kernel", "other"),
])
def test_kinds(name, kind):
    assert kind_of(name) == kind


def _trace(tmp_path: Path, events: list[dict]) -> list[dict]:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    return device_events(trace)


def test_device_time_per_step_by_kind(tmp_path):
    """Only device events count (a CPU op's time is host time), summed per kind and divided by the steps."""
    events = _trace(tmp_path, [
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_a", "ts": 0.0, "dur": 3000.0},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_b", "ts": 0.0, "dur": 1000.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 0.0, "dur": 500.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 9000.0},
        {"ph": "i", "cat": "kernel", "name": "nvjet_sm90_marker", "ts": 0.0, "dur": 7000.0},
    ])
    assert kernel_mix(events, steps=2) == {"GEMM": 2.0, "memcpy / memset": 0.25}


def test_exposed_communication(tmp_path):
    """A step of 1,000 us on two streams (compute on 7, NCCL on 20): an all-gather half under a GEMM, a reduce-scatter
    overlapped only by a memcpy (no compute) and an all-reduce with nothing beside it; a CPU op over all of it does
    not count. Exposed: 100 (all-gather's tail) + 200 (reduce-scatter) + 100 (all-reduce) = 400 us of 600 us of
    collectives, over the span from the first kernel's start (100) to the last one's end (1,100). No compute kernel
    runs for 550 us of it (400-850, 1,000-1,100): the bubble a pipeline stage's trace shows."""
    events = _trace(tmp_path, [
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_gemm", "ts": 100.0, "dur": 300.0, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 200.0, "dur": 300.0, "tid": 20},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 600.0, "dur": 200.0, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum_f32_RING_SIMPLE", "ts": 600.0, "dur": 200.0, "tid": 20},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_0", "ts": 850.0, "dur": 150.0, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ts": 1000.0, "dur": 100.0, "tid": 20},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5000.0, "tid": 1},
    ])
    # the all-gather (200-500) is overlapped by the GEMM until 400: 100 us exposed
    assert exposed_comm(events) == {"kernel_span_ms": 1.0, "comm_ms": 0.6, "exposed_comm_ms": 0.4, "exposed_comm_share": 0.4,
                                    "compute_idle_ms": 0.55, "compute_idle_share": 0.55,
                                    # the reduce-scatter beside the copy (no compute) is exposed whole
                                    "exposed_by_collective_ms": {"AllGather": 0.1, "AllReduce": 0.1, "ReduceScatter": 0.2},
                                    # by tenth of the span (100 us each): 400-500, 600-800, 1,000-1,100
                                    "exposed_by_part_ms": [0.0, 0.0, 0.0, 0.1, 0.0, 0.1, 0.1, 0.0, 0.0, 0.1]}
    assert exposed_comm(events, steps=2)["exposed_comm_ms"] == 0.2


def test_symmetric_memory_barrier_is_communication(tmp_path):
    """async TP's fused ops wait for the peer in a barrier kernel on the compute stream: its time is exposed
    communication, not compute, and is named apart."""
    events = _trace(tmp_path, [
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_gemm", "ts": 0.0, "dur": 100.0, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int)", "ts": 100.0,
         "dur": 50.0, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_gemm", "ts": 150.0, "dur": 100.0, "tid": 7},
    ])
    found = exposed_comm(events)
    assert (found["exposed_comm_ms"], found["compute_idle_ms"]) == (0.05, 0.05)
    assert found["exposed_by_collective_ms"] == {"symm_mem barrier": 0.05}


def test_no_device_events_no_reading(tmp_path):
    """A CPU run's trace has operators only: no kernel span to speak of."""
    events = _trace(tmp_path, [{"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 0.0, "dur": 10.0}])
    assert exposed_comm(events) == {}
