"""Qwen3 (torchtitan's definitions): dense and MoE flavors train in every mode, aot_fx_trace is bitwise
equal to eager on one rank, with TP (dense) and with EP (MoE), and the solver plans both."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO, cached_train, child_env, grad_norms, losses

DENSE = ("--config", "configs/qwen3_debug.toml")
MOE = ("--config", "configs/qwen3_moe_debug.toml")
SMALL = ("--model.n_layers", "2", "--training.batch_size", "4", "--training.seq_len", "64", "--training.steps", "3")


def run(model: tuple[str, ...], mode: str, *mesh: str, nproc: int = 1) -> list[dict]:
    return cached_train((*model, *SMALL, *mesh, "--compile.mode", mode), nproc)


@pytest.mark.parametrize("model", [DENSE, pytest.param(MOE, marks=pytest.mark.slow)], ids=["dense", "moe"])
def test_traced_step_bitwise_equal_to_eager_on_one_rank(model):
    eager, traced = run(model, "eager"), run(model, "aot_fx_trace")
    assert len(eager) == 3
    assert losses(traced) == losses(eager)
    assert grad_norms(traced) == grad_norms(eager)
    assert losses(eager)[-1] < losses(eager)[0]


@pytest.mark.slow
def test_moe_counts_no_dropped_tokens_without_capacity_factor():
    assert [r["dropped_tokens"] for r in run(MOE, "aot_fx_trace")] == [0, 0, 0]
    assert all("dropped_tokens" not in r for r in run(DENSE, "aot_fx_trace"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["jit", "aot"])
def test_other_modes_train_to_the_eager_losses(mode):
    # jit and aot run the step through AOTAutograd's partitioned graphs: same ops, same order on CPU.
    assert losses(run(DENSE, mode)) == losses(run(DENSE, "eager"))


@pytest.mark.slow
@pytest.mark.parametrize("model, mesh", [
    (DENSE, ("--parallelism.dp_shard", "1", "--parallelism.tp", "2")),
    (MOE, ("--parallelism.dp_shard", "2", "--parallelism.ep", "2")),
], ids=["dense_tp2", "moe_ep2"])
def test_traced_step_bitwise_equal_to_eager_on_two_ranks(model, mesh):
    eager, traced = run(model, "eager", *mesh, nproc=2), run(model, "aot_fx_trace", *mesh, nproc=2)
    assert losses(traced) == losses(eager)
    assert grad_norms(traced) == grad_norms(eager)


def test_ep_on_a_dense_flavor_is_refused():
    proc = subprocess.run([sys.executable, "-m", "graph_trainer", "train", *DENSE, "--parallelism.ep", "2"], cwd=REPO,
                          env=child_env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "qwen3 debugmodel has no experts" in proc.stderr


@pytest.mark.parametrize("model, mesh, moe", [
    (DENSE, ("--parallelism.dp_shard", "2", "--parallelism.tp", "2"), None),
    (MOE, ("--parallelism.dp_shard", "4", "--parallelism.ep", "4"), "experts"),
], ids=["dense", "moe"])
def test_solver_plans(tmp_path, model, mesh, moe):
    proc = subprocess.run([sys.executable, "-m", "graph_trainer", "plan", *model, "--model.n_layers", "2", *mesh,
                           "--job.dump_folder", str(tmp_path)], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    blocks = next(u for u in plan["units"] if "layers.0" in u["modules"])
    assert blocks["modules"] == ["layers.0", "layers.1"]
    assert {"attention.q_norm.weight", "attention.k_norm.weight"} <= set(blocks["params"])
    if moe:
        assert "dp_shard=experts" in proc.stdout
