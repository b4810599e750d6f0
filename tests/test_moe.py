"""DeepSeek V3 MoE: the static-shape dispatch, one traced graph for every routing, load balancing in
eager and aot_fx_trace, and expert parallelism (ep=2) / tensor parallelism against one rank."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer import trainer
from graph_trainer.config import parse_args
from graph_trainer.parallel import expert_parallel
from graph_trainer.parallel.moe_dispatch import DispatchPlan, dispatch_and_combine

from helpers import grad_norms, launch, losses, read_metrics, run_train

# A constant learning rate after warm-up, so runs of different lengths agree on their common steps.
SMALL = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--training.batch_size", "4", "--training.seq_len", "64",
         "--lr_scheduler.decay_ratio", "0"]
STEPS = 10
PAIRS_PER_STEP = 4 * 64 * 3  # batch * seq_len * top_k: what each MoE layer routes per step
_UPDATE_EXPERT_BIAS = expert_parallel._update_expert_bias


def _routing(seed: int, tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    # Skewed on purpose: a few experts get most pairs, as early in training.
    logits[:, 0] += 1.5
    scores, idx = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return scores, idx


def _reference(x, scores, idx, w1, w2, w3, kept):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            if kept[t, k]:
                e = idx[t, k]
                h = F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])
                out[t] += scores[t, k] * (w2[e] @ h)
    return out


@pytest.fixture()
def experts_and_tokens():
    g = torch.Generator().manual_seed(0)
    tokens, dim, hidden, experts = 24, 16, 8, 4
    x = torch.randn(tokens, dim, generator=g)
    w1, w3 = (torch.randn(experts, hidden, dim, generator=g) * 0.3 for _ in range(2))
    w2 = torch.randn(experts, dim, hidden, generator=g) * 0.3
    return x, w1, w2, w3


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_dispatch_matches_per_token_reference_and_drops_over_capacity(experts_and_tokens, capacity_factor):
    x, w1, w2, w3 = experts_and_tokens
    scores, idx = _routing(1, x.shape[0], w1.shape[0], top_k=2)
    plan = DispatchPlan(num_experts=4, top_k=2, ep_mesh=None, capacity_factor=capacity_factor, score_before_experts=False)
    result = dispatch_and_combine(plan, x, scores, idx, w1, w2, w3)

    pairs = idx.numel()
    capacity = plan.capacity(x.shape[0])
    # One peer: it keeps the first `capacity` pairs in (stable) expert order.
    kept = torch.zeros(pairs, dtype=torch.bool)
    kept[torch.argsort(idx.flatten(), stable=True)[:capacity]] = True
    expected = _reference(x, scores, idx, w1, w2, w3, kept.view_as(idx))
    torch.testing.assert_close(result.output, expected, rtol=1e-5, atol=1e-5)
    assert result.dropped.item() == pairs - capacity
    assert (capacity < pairs) == (capacity_factor > 0)
    assert torch.equal(result.tokens_per_expert, torch.bincount(idx.flatten(), minlength=4).float())


def test_one_traced_graph_serves_every_routing(experts_and_tokens):
    """Trace once on fake tensors, then run the graph on routings unlike the traced one: it must
    give eager's output and gradients bit for bit (no shapes taken from the routing)."""
    x, w1, w2, w3 = experts_and_tokens
    plan = DispatchPlan(num_experts=4, top_k=2, ep_mesh=None, capacity_factor=0.75, score_before_experts=False)

    def step(x, scores, idx, w1, w2, w3):
        out = dispatch_and_combine(plan, x, scores, idx, w1, w2, w3).output
        return (out, *torch.autograd.grad(out.square().sum(), [x, w1, w2, w3]))

    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
    scores, idx = _routing(2, x.shape[0], 4, top_k=2)
    gm = make_fx(step, tracing_mode="fake")(leaves[0], scores, idx, *leaves[1:])
    assert any("grouped_mm" in str(n.target) for n in gm.graph.nodes)
    counts = []
    for seed in (3, 4, 5):
        scores, idx = _routing(seed, x.shape[0], 4, top_k=2)
        counts.append(torch.bincount(idx.flatten(), minlength=4))
        eager = step(leaves[0], scores, idx, *leaves[1:])
        traced = gm(leaves[0], scores, idx, *leaves[1:])
        for a, b in zip(eager, traced):
            assert torch.equal(a, b)
    assert not torch.equal(counts[0], counts[1])


def _train_in_process(monkeypatch, tmp_path, mode: str) -> dict:
    """Train one rank in this process, recording what each optimizer step's load-balancing hook saw."""
    seen: dict[str, list[torch.Tensor]] = {"counts": [], "bias": []}

    def spy(blocks, meshes):
        seen["counts"].append(torch.stack([moe.tokens_per_expert.clone() for _, moe in blocks]))
        _UPDATE_EXPERT_BIAS(blocks, meshes)
        seen["bias"].append(torch.stack([moe.expert_bias.clone() for _, moe in blocks]))

    monkeypatch.setattr(expert_parallel, "_update_expert_bias", spy)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    cfg = parse_args([*SMALL, "--training.steps", str(STEPS), "--compile.mode", mode, "--job.dump_folder", str(tmp_path / mode),
                      "--metrics.progress_bar", "false"])
    trainer.run(cfg)
    return {"records": read_metrics(tmp_path / mode), **seen}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("moe_one_rank")
    try:
        return {mode: _train_in_process(monkeypatch, tmp, mode) for mode in ("eager", "aot_fx_trace")}
    finally:
        monkeypatch.undo()


def test_one_rank_traced_equals_eager_and_balances_load(one_rank):
    eager, traced = one_rank["eager"], one_rank["aot_fx_trace"]
    assert losses(traced["records"]) == losses(eager["records"])
    assert grad_norms(traced["records"]) == grad_norms(eager["records"])
    assert all(r["retraces"] == 0 for r in traced["records"])
    for run in (eager, traced):
        assert len(run["counts"]) == STEPS
        # The traced graph added into the real buffers: every layer counted every routed pair once.
        assert all(torch.all(c.sum(dim=1) == PAIRS_PER_STEP) for c in run["counts"])
        assert run["bias"][0].abs().sum() > 0
    for key in ("counts", "bias"):
        assert all(torch.equal(a, b) for a, b in zip(eager[key], traced[key]))
    # Routing changes between steps, and the one traced graph served all of them.
    assert not torch.equal(traced["counts"][0], traced["counts"][1])
    assert not torch.equal(traced["bias"][0], traced["bias"][1])


@pytest.mark.slow
def test_expert_parallel_matches_one_rank_and_traces_all_to_all(one_rank, tmp_path):
    ep = ["--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--training.steps", str(STEPS)]
    eager = run_train([*SMALL, *ep, "--compile.mode", "eager"], tmp_path / "eager", nproc=2)
    traced = run_train([*SMALL, *ep, "--compile.mode", "aot_fx_trace", "--compile.dump_graphs"], tmp_path / "traced", nproc=2)
    assert losses(traced) == losses(eager)
    assert grad_norms(traced) == grad_norms(eager)
    assert all(r["retraces"] == 0 for r in traced)
    single = one_rank["eager"]["records"]
    assert max(abs(a - b) for a, b in zip(losses(eager), losses(single))) < 1e-5
    # Gradients agree to ~1e-6; the norm differs more because CPU fp32 norms of shards round differently.
    assert all(math.isclose(a, b, rel_tol=1e-3) for a, b in zip(grad_norms(eager), grad_norms(single)))
    summary = json.loads((tmp_path / "traced" / "graphs" / "summary.json").read_text())
    traced_stage = summary["stages"][0]
    # Per MoE layer (5): rows, counts and outputs in forward; rows and outputs again in backward.
    assert traced_stage["collectives"]["all_to_all"]["count"] == 5 * 5


@pytest.mark.slow
def test_capacity_factor_below_one_drops_tokens_and_trains(tmp_path):
    args = [*SMALL, "--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--training.steps", "3",
            "--compile.mode", "aot_fx_trace", "--parallelism.moe_capacity_factor", "0.5"]
    proc = launch(["train", "--job.dump_folder", str(tmp_path), *args], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dropped = [line for line in proc.stderr.splitlines() if "moe: dropped" in line]
    assert len(dropped) == 3
    records = read_metrics(tmp_path)
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)


@pytest.mark.slow
def test_tensor_parallel_with_dp_shard(one_rank, tmp_path):
    tp = ["--parallelism.dp_shard", "2", "--parallelism.tp", "2", "--training.steps", "5"]
    eager = run_train([*SMALL, *tp, "--compile.mode", "eager"], tmp_path / "eager", nproc=4)
    traced = run_train([*SMALL, *tp, "--compile.mode", "aot_fx_trace"], tmp_path / "traced", nproc=4)
    assert losses(traced) == losses(eager)
    single = losses(one_rank["eager"]["records"])[:5]
    assert max(abs(a - b) for a, b in zip(losses(eager), single)) < 1e-5


def test_trains_on_random_tokens(tmp_path):
    """`--training.random_tokens` (the benchmarks' data) draws from the model's own vocabulary size,
    which DeepSeek V3 keeps in its model args only."""
    records = run_train([*SMALL, "--training.random_tokens", "--training.steps", "2"], tmp_path)
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)
