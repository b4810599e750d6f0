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
    assert (folder / "profile" / "trace.json").stat().st_size > 0
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
