"""The profiler window: interval arithmetic behind `exposed_comm_share`, and a profiled run's files."""

from __future__ import annotations

import json

import pytest

from helpers import run_train

from graph_trainer.profiling import is_collective, uncovered_length, union_length


def test_union_and_uncovered_lengths():
    assert union_length([(0, 4), (2, 6), (8, 9)]) == 7
    compute = [(0, 5), (7, 10)]
    # comm 3..8 overlaps compute on 3..5 and 7..8: 2 of its 5 units are exposed
    assert uncovered_length([(3, 8)], compute) == 2
    assert uncovered_length([(3, 8), (4, 6)], compute) == 2
    assert uncovered_length([(11, 12)], compute) == 1
    assert uncovered_length([(1, 2)], compute) == 0


def test_collective_names():
    assert is_collective("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    assert is_collective("_c10d_functional::reduce_scatter_tensor")
    assert not is_collective("aten::mm") and not is_collective("triton_per_fused_add_mean_mul_0")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profiled")
    records = run_train(["--training.steps", "4", "--training.batch_size", "2", "--training.seq_len", "64",
                         "--compile.mode", "aot_fx_trace", "--profiling.enable", "--profiling.start_step", "2",
                         "--profiling.steps", "2", "--metrics.progress_bar", "false"], folder)
    return folder, records


def test_profiled_steps_are_marked_and_summarised(profiled):
    folder, records = profiled
    assert [r.get("profiled", False) for r in records] == [False, True, True, False]
    summary = json.loads((folder / "profile" / "summary.json").read_text())
    # the profiler started at step 1, a warm-up step whose events it dropped: the trace holds steps 2 and 3
    trace = json.loads((folder / "profile" / "trace.json").read_text())
    assert sorted(e["name"] for e in trace["traceEvents"] if str(e.get("name")).startswith("ProfilerStep")) == [
        "ProfilerStep#1", "ProfilerStep#2"]
    assert summary["steps"] == 2 and summary["device"] == "cpu"
    names = [k["name"] for k in summary["top_kernels"]]
    assert "aten::mm" in names
    # One rank: no gathers or reduce-scatters; the only collective is the per-step stop-signal vote.
    assert not any("all_gather" in n or "reduce_scatter" in n for n in names)
    assert 0 <= summary["exposed_comm_ms"] <= summary["comm_ms"] < 0.2 * summary["step_time_ms"]
    assert 0 < summary["busy_ms"] <= summary["step_time_ms"] * 1.05
    shares = [k["share_of_kernel_time"] for k in summary["top_kernels"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    mm = next(k for k in summary["top_kernels"] if k["name"] == "aten::mm")
    assert mm["share_of_kernel_time"] == pytest.approx(mm["ms_per_step"] / summary["kernel_ms"])


def test_memory_at_peak_names_the_compiled_lines_live_at_the_peak(tmp_path):
    """memory_peak.json: the peak over the recorded steps (with what was allocated before the recording) and the
    blocks live there by allocating line, a compiled graph's line with the nodes Inductor's comment names."""
    from graph_trainer.profiling import memory_at_peak

    code = tmp_path / "torchinductor_x" / "cabc.py"
    code.parent.mkdir()
    code.write_text("def call(args):\n"
                    "    # Topologically Sorted Source Nodes: [zeros_1, add_], Original ATen: [aten.zeros]\n"
                    "    buf3 = empty_strided_cuda((128256, 4096), (4096, 1), torch.float32)\n"
                    "    buf4 = empty_strided_cuda((2048, 128256), (128256, 1), torch.bfloat16)\n")
    torch_frame = {"filename": "/site-packages/torch/_ops.py", "line": 9, "name": "__call__"}

    def event(action: str, addr: int, size: int, line: int = 3) -> dict:
        return {"action": action, "addr": addr, "size": size,
                "frames": [torch_frame, {"filename": str(code), "line": line, "name": "call"}]}

    trace = [event("alloc", 1, 100), event("alloc", 2, 50, 4), event("free_completed", 2, 50, 4),
             event("alloc", 3, 70), event("free_requested", 1, 100), event("free_completed", 1, 100),
             event("alloc", 4, 20, 4), event("free_completed", 99, 30)]
    got = memory_at_peak(trace, before=1000)
    # peak after block 3: 1000 + 100 + 70 (block 2 was freed before it); the later free of a block allocated before
    # the recording (99) lowers the running total, not the peak
    assert got["peak_bytes"] == 1170 and got["before_recording_bytes"] == 1000
    assert got["at_peak"] == [{"where": f"{code}:3", "bytes": 170, "blocks": 2,
                               "code": "buf3 = empty_strided_cuda((128256, 4096), (4096, 1), torch.float32)  "
                                       "# Topologically Sorted Source Nodes: [zeros_1, add_], Original ATen: [aten.zeros]"}]

