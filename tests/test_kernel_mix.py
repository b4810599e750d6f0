"""bench/kernel_mix.py: kernel time of a profiled step by kind, from a Chrome trace, so two trainers' steps
(ours, torchtitan's) compare kind by kind. The names below are kernels seen in the H200 and H100 profiles."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from kernel_mix import kernel_mix, kind_of  # noqa: E402


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
    ("some_vendor_kernel", "other"),
])
def test_kinds(name, kind):
    assert kind_of(name) == kind


def test_device_time_per_step_by_kind(tmp_path):
    """Only device events count (a CPU op's time is host time), summed per kind and divided by the steps."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_a", "dur": 3000.0},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_b", "dur": 1000.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "dur": 500.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9000.0},
        {"ph": "i", "cat": "kernel", "name": "nvjet_sm90_marker", "dur": 7000.0},
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    assert kernel_mix(trace, steps=2) == {"GEMM": 2.0, "memcpy / memset": 0.25}
