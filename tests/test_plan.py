"""`graph-trainer plan` end to end, plan reuse in `train`, training parity of auto-placed runs, bad input."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.helpers import cached_train, child_env, grad_norms, launch, losses, run_train

STEPS = 10
COMMON = ["--training.steps", str(STEPS), "--metrics.progress_bar", "false", "--compile.mode", "aot_fx_trace"]


def _plan(tmp_path, *flags: str):
    return launch(["plan", "--job.dump_folder", str(tmp_path), *flags])


def test_plan_command_prints_and_writes(tmp_path):
    proc = _plan(tmp_path, "--parallelism.dp_shard", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "layers.*.attention.wq.weight" in out and out.count("layers.*.attention.wq.weight") == 1
    assert "predicted per step and rank" in out and "program:" in out and "solve" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh"]["shape"] == [1, 2, 1] and plan["model"]["flavor"] == "debugmodel"
    assert f"plan written to {tmp_path / 'plan.json'}" in out


DOCUMENTED_PLAN_S = {"8B on 8": 0.62, "8B on 8 x 8": 2.68, "70B on 8 x 8": 3.01}
"""trace + build + solve as docs/placement.md states them for a quiet 2-core machine (the slowest of three runs)."""
LOADED = 3.0
"""The suite's two xdist workers keep a 2-core CI machine at load 2-4 (CI planned the 8B on 8 x 8 in 5.0-5.6 s
there, 1.9-2.1x the quiet figure); the rest is room for a neighbour's burst (at load 12-17 docs/placement.md
states 1.9-2.6x the quiet figures)."""


ATTEMPTS = 3
"""A neighbour's burst only adds time: the plan is timed again, up to this many times, until one is under the
limit (CI once measured 0.93 s for the 0.2 s plan; the same commit planned in 0.24 s on a quiet machine)."""


def planned_in_time(tmp_path, limit_s: float, *flags: str) -> dict:
    """Run `graph-trainer plan`; its printed total (trace + build + solve) and plan.json's agree, and the
    least of up to `ATTEMPTS` runs is under the limit."""
    totals = []
    while len(totals) < ATTEMPTS and (not totals or min(totals) >= limit_s):
        proc = _plan(tmp_path, *flags)
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed = re.search(r"^time: trace .* = ([\d.]+) s$", proc.stdout, re.MULTILINE)
        plan = json.loads((tmp_path / "plan.json").read_text())
        assert printed and float(printed.group(1)) == pytest.approx(plan["program"]["total_s"], abs=0.01)
        totals.append(plan["program"]["total_s"])
    assert min(totals) < limit_s, (totals, plan["program"])
    return plan


DOCUMENTED_AC = {
    "8B": ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"),
    "70B": ("--activation_checkpoint.mode", "full", "--training.batch_size", "8"),
}
"""The configs' settings when the plan times were documented (the configs now carry the memory policy)."""


@pytest.mark.slow
def test_plan_8b_on_8_fake_ranks_is_fast(tmp_path):
    planned_in_time(tmp_path, LOADED * DOCUMENTED_PLAN_S["8B on 8"], "--config", "configs/llama3_8b.toml", "--parallelism.dp_shard", "8",
                    *DOCUMENTED_AC["8B"])


@pytest.mark.slow
def test_plan_8b_on_8x8_fake_ranks_is_fast(tmp_path):
    plan = planned_in_time(tmp_path, LOADED * DOCUMENTED_PLAN_S["8B on 8 x 8"], "--config", "configs/llama3_8b.toml",
                           "--parallelism.dp_shard", "8", "--parallelism.tp", "8", *DOCUMENTED_AC["8B"])
    assert plan["params"]["layers.*.feed_forward.w1.weight"]["compute"] == ["R", "S0"]


@pytest.mark.slow
def test_plan_70b_on_8x8_fake_ranks_is_fast(tmp_path):
    plan = planned_in_time(tmp_path, LOADED * DOCUMENTED_PLAN_S["70B on 8 x 8"], "--config", "configs/llama3_70b.toml",
                           "--parallelism.dp_shard", "8", "--parallelism.tp", "8", *DOCUMENTED_AC["70B"])
    assert plan["params"]["layers.*.feed_forward.w2.weight"]["compute"] == ["R", "S1"]


@pytest.mark.slow
def test_auto_placed_training_matches_manual():
    """dp_shard 2 x tp 2 on 4 ranks (auto-placed dp_shard 2 alone trains in test_autoparallel_backend.py and
    test_checkpoint.py); the manual run is test_fx_trace's, trained once for both."""
    from test_fx_trace import args as fx_trace_args

    flags, nproc = fx_trace_args("dp_shard2_tp2", "aot_fx_trace")
    manual = cached_train(flags, nproc)
    auto = cached_train((*flags, "--compile.autoparallel"), nproc)
    assert len(losses(auto)) == len(losses(manual)) == STEPS
    for a, m in zip(losses(auto), losses(manual)):
        assert abs(a - m) <= 1e-5, (losses(auto), losses(manual))


@pytest.mark.slow
def test_train_reuses_a_saved_plan(tmp_path):
    assert _plan(tmp_path / "p", "--parallelism.dp_shard", "2").returncode == 0
    plan_file = tmp_path / "p" / "plan.json"
    records = run_train([*COMMON[:4], "--training.steps", "3", "--compile.mode", "aot_fx_trace", "--compile.autoparallel",
                         "--compile.autoparallel_plan", str(plan_file), "--parallelism.dp_shard", "2"], tmp_path / "t", nproc=2)
    manual = run_train(["--training.steps", "3", "--metrics.progress_bar", "false", "--parallelism.dp_shard", "2"], tmp_path / "m", nproc=2)
    assert [round(x, 5) for x in losses(records)] == [round(x, 5) for x in losses(manual)]


NORM_OPS = ["pow", "mean", "add_", "rsqrt", "mul", "mul"]
"""The ops of an RMSNorm as traced (trace._rms_norm): x^2, its mean, + eps, rsqrt, x * rms, * weight."""


def _solver_plan(flags: list[str]) -> dict:
    """The built-in solver's plan for these flags, solved in this process on a fake process group that
    is destroyed again (the test process keeps no process group)."""
    import torch.distributed as dist

    from graph_trainer.config import parse_args
    from graph_trainer.plan import make_plan

    try:
        return make_plan(parse_args(flags))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _shard_norms_over_hidden(plan: dict, unit: str, hidden: list[str]) -> None:
    """Edit every norm of the `unit` units ("norm", or "layers" for the blocks) into layout `hidden`:
    the mesh dims holding "S2" shard the hidden dim, so the RMS `mean` is Partial("avg") there and is
    reduced to Replicate for rsqrt; the norm weight is used replicated. The solver replicates the debug
    model's norms, which is why tests edit them into the layout the 8B dp4 x tp2 plan chose."""
    avg = ["Pavg" if p == "S2" else p for p in hidden]
    rms = ["R" if p == "S2" else p for p in hidden]
    weight = ["R"] * len(hidden)
    layouts = [([hidden], [hidden]), ([hidden], [avg]), ([rms], [rms]), ([rms], [rms]), ([hidden, rms], [hidden]),
               ([hidden, weight], [hidden])]
    units = [u for u in plan["units"] if u["modules"][0].split(".")[0] == unit]
    assert units, [u["modules"][0] for u in plan["units"]]
    for u in units:
        starts = [i for i, n in enumerate(u["nodes"]) if n["op"] == "pow"]
        assert starts, [n["op"] for n in u["nodes"]]
        for i in starts:
            norm = u["nodes"][i : i + len(NORM_OPS)]
            assert [n["op"] for n in norm] == NORM_OPS
            for node, (ins, outs) in zip(norm, layouts):
                node["ins"], node["outs"] = ins, outs
        if u["modules"] == ["norm"]:
            u["inputs"] = [hidden]


@pytest.mark.slow
def test_norm_sharded_over_its_hidden_dim_on_tp_trains(tmp_path):
    """The 8B dp4 x tp2 plan shards the norms' hidden dim on tp: the RMS `mean` is then Partial("avg"),
    redistributed to Replicate, and its gradient (through `x * rsqrt(...)`) arrives as a Partial sum,
    which DTensor could not send back to Partial("avg") (the H200 run failed tracing so). The debug
    model's plan replicates its norms, so the final norm is edited into that layout."""
    flags = ["--config", "configs/llama3_debug.toml", "--model.n_layers", "1", "--parallelism.dp_shard", "1",
             "--parallelism.tp", "2", "--compile.mode", "aot_fx_trace"]
    plan = _solver_plan(flags)
    (tmp_path / "replicated.json").write_text(json.dumps(plan))
    _shard_norms_over_hidden(plan, "norm", ["S2"])
    (tmp_path / "hidden.json").write_text(json.dumps(plan))
    run = [*flags[2:], "--training.steps", "2", "--metrics.progress_bar", "false", "--compile.autoparallel"]
    hidden_run = run_train([*run, "--compile.autoparallel_plan", str(tmp_path / "hidden.json")], tmp_path / "h", nproc=2)
    replicated_run = run_train([*run, "--compile.autoparallel_plan", str(tmp_path / "replicated.json")], tmp_path / "r", nproc=2)
    # fp32 on CPU; the two plans differ only in the order the final norm sums its 256 squares (two halves
    # of 128, then added) and an exact halving: a few ulps, under 1e-6 after two steps (equal when checked).
    # The gradient of the RMS left unreduced (each rank's half) moves the first grad norm by 5e-5 and the
    # second loss by 4e-6, relative (checked)
    assert len(losses(hidden_run)) == 2
    for h, r in zip(losses(hidden_run) + grad_norms(hidden_run), losses(replicated_run) + grad_norms(replicated_run)):
        assert h == pytest.approx(r, rel=1e-6), (hidden_run, replicated_run)


def test_norms_sharded_over_hidden_on_dp_shard_x_tp_trace_and_train(tmp_path):
    """The failing 8B dp4 x tp2 job in small: rank 0 of dp_shard 2 x tp 2 (fake communication), auto
    placed, every second block recomputed in backward, and every norm's hidden dim sharded: the blocks'
    over both mesh dims (the RMS Partial("avg") on both), the final norm's on tp beside the batch split
    on dp_shard. Redistributing the RMS straight from Partial("avg") failed tracing the backward here
    ("Redistribution from one partial type (P(sum)) to another (P(avg))", checked). Fake collectives
    move no data, so the losses are held finite, not to the manual run's (test_auto_placed_training_
    matches_manual and the slow test above compare with real collectives)."""
    flags = ["--config", "configs/llama3_debug.toml", "--training.seq_len", "64", "--training.batch_size", "4",
             "--parallelism.dp_shard", "2", "--parallelism.tp", "2", "--compile.mode", "aot_fx_trace"]
    plan = _solver_plan(flags)
    _shard_norms_over_hidden(plan, "layers", ["S2", "S2"])
    _shard_norms_over_hidden(plan, "norm", ["S0", "S2"])
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    records = run_train([*flags[2:], "--training.steps", "2", "--metrics.progress_bar", "false", "--comm.mode", "fake",
                         "--comm.fake_world_size", "4", "--activation_checkpoint.mode", "selective",
                         "--activation_checkpoint.selective_ac_option", "2", "--compile.autoparallel",
                         "--compile.autoparallel_plan", str(tmp_path / "plan.json")], tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(x) for x in losses(records) + grad_norms(records)), records


def _one_rank_error(args: list[str]) -> str:
    env = child_env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    proc = launch(["train", *args], env=env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    line = [ln for ln in proc.stderr.splitlines() if "graph-trainer: error" in ln]
    assert len(line) == 1, proc.stderr[-2000:]
    return line[0]


def test_plan_for_another_model_or_mesh_is_refused(tmp_path):
    assert _plan(tmp_path, "--parallelism.dp_shard", "2").returncode == 0
    plan_file = str(tmp_path / "plan.json")
    msg = _one_rank_error(["--compile.autoparallel", "--compile.autoparallel_plan", plan_file, "--model.n_layers", "2"])
    assert "was made for model llama3 debugmodel" in msg
    env = child_env(WORLD_SIZE="4", RANK="0", LOCAL_RANK="0")
    proc = launch(["train", "--compile.autoparallel", "--compile.autoparallel_plan", plan_file, "--parallelism.tp", "2"], env=env)
    assert proc.returncode == 2 and "was made for mesh (dp_replicate, dp_shard, tp) = (1, 2, 1)" in proc.stderr


def test_infeasible_budget_from_the_cli(tmp_path):
    proc = _plan(tmp_path, "--parallelism.dp_shard", "2", "--compile.autoparallel_memory_budget", "1MiB")
    assert proc.returncode == 2
    # sharded states 0.05 GiB + what autograd keeps of 8 x 256 tokens per rank 0.08 GiB (tests/test_solver.py)
    assert "infeasible" in proc.stderr and "autoparallel_memory_budget 0.13GiB" in proc.stderr
