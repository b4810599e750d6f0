"""DeepSeek V3 MoE: the static-shape dispatch, one traced graph for every routing, load balancing in
eager and aot_fx_trace, and expert parallelism (ep=2) / tensor parallelism against one rank."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer import trainer
from graph_trainer.compare import torchrun
from graph_trainer.config import parse_args
from graph_trainer.parallel import expert_parallel
from graph_trainer.parallel.moe_dispatch import DispatchPlan, dispatch_and_combine

import moe_skew
from helpers import REPO, child_env, grad_norms, losses, read_metrics, run_train

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


def _kept_by_score(scores: torch.Tensor, experts: torch.Tensor, capacity: int, ep: int, num_experts: int) -> torch.Tensor:
    """The documented rule, written plainly: each peer keeps its `capacity` pairs of highest score,
    equal scores in (token, k) order. Returns a (tokens, top_k) bool mask."""
    flat_scores, flat_experts = scores.flatten().tolist(), experts.flatten().tolist()
    kept = torch.zeros(len(flat_scores), dtype=torch.bool)
    for peer in range(ep):
        mine = [i for i, e in enumerate(flat_experts) if e // (num_experts // ep) == peer]
        for i in sorted(mine, key=lambda i: (-flat_scores[i], i))[:capacity]:
            kept[i] = True
    return kept.view_as(experts)


def _kept_in_expert_order(experts: torch.Tensor, capacity: int) -> torch.Tensor:
    """The old rule (one peer): the buffer filled in expert order, so overflow hit the highest experts."""
    kept = torch.zeros(experts.numel(), dtype=torch.bool)
    kept[torch.argsort(experts.flatten(), stable=True)[:capacity]] = True
    return kept.view_as(experts)


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_dispatch_matches_per_token_reference_and_drops_lowest_scores(experts_and_tokens, capacity_factor):
    x, w1, w2, w3 = experts_and_tokens
    scores, idx = _routing(1, x.shape[0], w1.shape[0], top_k=2)
    plan = DispatchPlan(num_experts=4, top_k=2, ep_mesh=None, capacity_factor=capacity_factor, score_before_experts=False)
    result = dispatch_and_combine(plan, x, scores, idx, w1, w2, w3)

    pairs = idx.numel()
    capacity = plan.capacity(x.shape[0])
    kept = _kept_by_score(scores, idx, capacity, ep=1, num_experts=4)
    expected = _reference(x, scores, idx, w1, w2, w3, kept)
    torch.testing.assert_close(result.output, expected, rtol=1e-5, atol=1e-5)
    assert result.dropped.item() == pairs - capacity
    assert (capacity < pairs) == (capacity_factor > 0)
    # Load-balancing counts: the pairs each expert processed, dropped ones left out.
    assert torch.equal(result.tokens_per_expert, torch.bincount(idx[kept], minlength=4).float())
    if capacity_factor > 0:
        assert not torch.equal(kept, _kept_in_expert_order(idx, capacity))


def test_full_buffer_drops_lowest_scores_not_highest_experts(experts_and_tokens):
    """A hot expert 0 with weak scores and expert 3 with stronger ones: the old expert-order rule kept
    12 of expert 0's pairs and dropped all of expert 3; the score rule keeps expert 3's pairs and
    drops expert 0's weakest."""
    x, w1, w2, w3 = experts_and_tokens
    idx = torch.tensor([0] * 18 + [3] * 6).unsqueeze(1)
    scores = torch.cat([0.10 + 0.001 * torch.arange(18.0), torch.full((6,), 0.3)]).unsqueeze(1)
    plan = DispatchPlan(num_experts=4, top_k=1, ep_mesh=None, capacity_factor=0.5, score_before_experts=False)
    assert plan.capacity(24) == 12
    result = dispatch_and_combine(plan, x, scores, idx, w1, w2, w3)
    kept = torch.tensor([False] * 12 + [True] * 12).unsqueeze(1)
    assert not _kept_in_expert_order(idx, 12)[18:].any()
    torch.testing.assert_close(result.output, _reference(x, scores, idx, w1, w2, w3, kept), rtol=1e-5, atol=1e-5)
    assert torch.all(result.output[:12] == 0) and torch.all(result.output[18:].abs().sum(dim=1) > 0)
    assert result.tokens_per_expert.tolist() == [6.0, 0.0, 0.0, 6.0]
    assert result.dropped.item() == 12


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


def _train_in_process(monkeypatch, folder, mode: str, args: list[str] = (), steps: int = STEPS, skew: bool = False) -> dict:
    """Train one rank in this process, recording what each optimizer step's load-balancing hook saw
    and, for a skewed eager run, every dispatch call's routing."""
    seen: dict[str, list] = {"counts": [], "dropped": [], "bias": [], "calls": []}

    def spy(moes, meshes):
        seen["counts"].append(torch.stack([moe.tokens_per_expert.clone() for moe in moes]))
        seen["dropped"].append(torch.stack([moe.tokens_dropped.clone() for moe in moes]))
        total = _UPDATE_EXPERT_BIAS(moes, meshes)
        seen["bias"].append(torch.stack([moe.expert_bias.clone() for moe in moes]))
        return total

    monkeypatch.setattr(expert_parallel, "_update_expert_bias", spy)
    if skew:
        moe_skew.install(monkeypatch.setattr, seen["calls"] if mode == "eager" else None)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    cfg = parse_args([*SMALL, "--training.steps", str(steps), *args, "--compile.mode", mode, "--job.dump_folder", str(folder / mode),
                      "--metrics.progress_bar", "false"])
    try:
        trainer.run(cfg)
    finally:
        monkeypatch.undo()
    return {"records": read_metrics(folder / mode), **seen}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_one_rank")
    return {mode: _train_in_process(pytest.MonkeyPatch(), tmp, mode) for mode in ("eager", "aot_fx_trace")}


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


EXPERTS = 8
# Skewed runs: 3 layers, the first dense (the debug model's layout), so 2 MoE blocks route per step.
SKEWED_LAYERS, MOE_LAYERS = ["--model.n_layers", "3"], 2
SKEWED_STEPS, SKEWED_FACTOR = 4, 0.5


def _expected_drops(calls: list, ep: int, capacity_factor: float) -> list[int]:
    """Pairs dropped by each dispatch call, counted from its routing alone: each peer's buffer holds
    ceil(f * pairs / ep) rows and drops whatever of its pairs exceed that."""
    drops = []
    for _, experts in calls:
        pairs = experts.numel()
        capacity = min(pairs, math.ceil(capacity_factor * pairs / ep))
        per_peer = torch.bincount(experts.flatten() // (EXPERTS // ep), minlength=ep)
        drops.append(int((per_peer - capacity).clamp(min=0).sum()))
    return drops


@pytest.fixture(scope="module")
def skewed_one_rank(tmp_path_factory):
    """Expert 0 chosen by every token, capacity factor 0.5: every MoE layer drops pairs every step."""
    tmp = tmp_path_factory.mktemp("moe_skewed")
    args = [*SKEWED_LAYERS, "--parallelism.moe_capacity_factor", str(SKEWED_FACTOR)]
    # The traced run recomputes its blocks (full AC): its counts and drops must still be the eager run's.
    return {mode: _train_in_process(pytest.MonkeyPatch(), tmp, mode, [*args, "--activation_checkpoint.mode", ac], steps=SKEWED_STEPS,
                                    skew=True)
            for mode, ac in (("eager", "none"), ("aot_fx_trace", "full"))}


def test_skewed_routing_drops_lowest_scores_and_counts_only_kept_pairs(skewed_one_rank):
    eager, traced = skewed_one_rank["eager"], skewed_one_rank["aot_fx_trace"]
    calls = eager["calls"]
    assert len(calls) == SKEWED_STEPS * MOE_LAYERS
    assert all(torch.all((experts == 0).any(dim=1)) for _, experts in calls)
    capacity = math.ceil(SKEWED_FACTOR * PAIRS_PER_STEP)
    drops = _expected_drops(calls, 1, SKEWED_FACTOR)
    assert all(d == PAIRS_PER_STEP - capacity for d in drops)
    for step in range(SKEWED_STEPS):
        layer_calls = calls[step * MOE_LAYERS:(step + 1) * MOE_LAYERS]
        for layer, (scores, experts) in enumerate(layer_calls):
            kept = _kept_by_score(scores, experts, capacity, 1, EXPERTS)
            # The old rule would have kept every pair of the hot expert 0 and dropped the highest experts.
            assert not torch.equal(kept, _kept_in_expert_order(experts, capacity))
            # The load-balancing hook saw exactly the kept pairs per expert, and the dropped ones apart.
            assert torch.equal(eager["counts"][step][layer], torch.bincount(experts[kept], minlength=EXPERTS).float())
            assert eager["dropped"][step][layer].item() == drops[step * MOE_LAYERS + layer]
    assert [r["dropped_tokens"] for r in eager["records"]] == [
        sum(drops[s * MOE_LAYERS:(s + 1) * MOE_LAYERS]) for s in range(SKEWED_STEPS)
    ]
    # The traced step drops the same pairs: bitwise the same run.
    assert losses(traced["records"]) == losses(eager["records"])
    assert grad_norms(traced["records"]) == grad_norms(eager["records"])
    assert [r["dropped_tokens"] for r in traced["records"]] == [r["dropped_tokens"] for r in eager["records"]]
    assert all(torch.equal(a, b) for a, b in zip(traced["counts"], eager["counts"]))


@pytest.mark.parametrize("mode,ac", [("eager", "full"), ("aot", "selective"), ("jit", "full")])
def test_recomputed_blocks_count_their_routing_once(mode, ac, tmp_path, monkeypatch):
    """Activation checkpointing re-runs a block's forward in eager mode (and in aot_fx_trace, above) but
    not in the graphs of aot and jit; in each the counts are those of one forward. With one peer (ep 1)
    each MoE layer keeps ceil(f * pairs) pairs whatever the routing and drops the rest. Selective AC
    (every second layer) recomputes one of the two MoE layers."""
    batch, seq_len = 2, 32
    args = [*SKEWED_LAYERS, "--training.batch_size", str(batch), "--training.seq_len", str(seq_len), "--training.random_tokens",
            "--parallelism.moe_capacity_factor", str(SKEWED_FACTOR), "--activation_checkpoint.mode", ac,
            "--compile.inductor_compilation", "none"]
    run = _train_in_process(monkeypatch, tmp_path, mode, args, steps=1)
    pairs = batch * seq_len * 3
    kept = math.ceil(SKEWED_FACTOR * pairs)
    assert [c.sum(dim=1).tolist() for c in run["counts"]] == [[kept] * MOE_LAYERS]
    assert [r["dropped_tokens"] for r in run["records"]] == [MOE_LAYERS * (pairs - kept)]


def test_without_capacity_factor_nothing_is_dropped(one_rank):
    """`dropped_tokens` is in every record of an MoE run, 0 when the buffers hold every pair."""
    assert [r["dropped_tokens"] for r in one_rank["eager"]["records"]] == [0] * STEPS


@pytest.mark.slow
def test_expert_parallel_drops_counted_over_ranks_and_traced_equals_eager(tmp_path):
    """ep=2 with a hot expert 0 and capacity factor 1: the peer holding expert 0 overflows. The
    recorded routing of both ranks gives the global count each metrics record must hold."""
    args = [*SMALL, *SKEWED_LAYERS, "--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--training.steps", "3",
            "--parallelism.moe_capacity_factor", "1.0"]
    records = {}
    for mode, record_dir in (("eager", str(tmp_path / "calls")), ("aot_fx_trace", "-")):
        cmd = [*torchrun(2), str(REPO / "tests" / "moe_skew.py"), record_dir, "train", "--job.dump_folder", str(tmp_path / mode), *args,
               "--compile.mode", mode]
        proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "moe: dropped" not in proc.stderr
        records[mode] = read_metrics(tmp_path / mode)
    eager, traced = records["eager"], records["aot_fx_trace"]
    assert losses(traced) == losses(eager)
    assert grad_norms(traced) == grad_norms(eager)
    calls = [torch.load(tmp_path / "calls" / f"rank{r}.pt") for r in (0, 1)]
    expected = [sum(sum(_expected_drops(c[s * MOE_LAYERS:(s + 1) * MOE_LAYERS], 2, 1.0)) for c in calls) for s in range(3)]
    assert all(expected)
    assert [r["dropped_tokens"] for r in eager] == expected
    assert [r["dropped_tokens"] for r in traced] == expected


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


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_dispatch_keeps_for_backward_what_the_cost_model_prices(capacity_factor):
    """The solver's memory model (moe.strategy_cost's saved_bytes) is the activation memory the dispatch
    keeps for backward: the expert rows, their two hidden projections (not silu's output nor the
    product: recomputed) and the pairs' outputs in bf16 (not their fp32 copy)."""
    from types import SimpleNamespace

    from graph_trainer.autoparallel.moe import strategy_cost
    from graph_trainer.autoparallel.strategies import Strategy
    from graph_trainer.hardware import H100

    tokens, dim, hidden, experts, top_k = 64, 32, 16, 4, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g).bfloat16().requires_grad_()
    w1, w3 = (torch.randn(experts, hidden, dim, generator=g).bfloat16().requires_grad_() for _ in range(2))
    w2 = torch.randn(experts, dim, hidden, generator=g).bfloat16().requires_grad_()
    scores, idx = _routing(6, tokens, experts, top_k)
    scores.requires_grad_()
    plan = DispatchPlan(num_experts=experts, top_k=top_k, ep_mesh=None, capacity_factor=capacity_factor, score_before_experts=False)

    kept: dict[int, int] = {}
    weights = {w.untyped_storage().data_ptr() for w in (w1, w2, w3)}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.is_floating_point() and t.dim() >= 2 and storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        dispatch_and_combine(plan, x, scores, idx, w1, w2, w3)

    args = [SimpleNamespace(meta={"val": t}) for t in (x, scores, idx, w1, w2, w3)]
    replicated = Strategy((("R",),), tuple(("R",) for _ in range(6)))
    cost = strategy_cost(SimpleNamespace(args=args), replicated, [1], comm=None, hw=H100, capacity_factor=capacity_factor)
    # the (tokens, 1, top_k) fp32 scores the weighted sum keeps are the only other float tensor
    assert sum(kept.values()) == cost.saved_bytes + tokens * top_k * 4
