"""The solver on DeepSeek V3: routed experts as one op with declared strategies (autoparallel/moe.py),
their choice on fake meshes, the `--parallelism.ep` pin, plan files, and training parity."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from graph_trainer.autoparallel import report
from graph_trainer.autoparallel.moe import routed_experts
from graph_trainer.config import ConfigError, parse_args
from graph_trainer.plan import make_plan
from graph_trainer.validate import validate
from tests.helpers import launch, losses, run_train

DEBUG = ("--config", "configs/deepseek_v3_debug.toml")
FULL_AC = ("--activation_checkpoint.mode", "full")
"""For 16B plans: the plan counts the activations the AC policy keeps, and on CPU MLA attention (q/k head dim
192, v 128: no fused CPU kernel) is traced as bmm + softmax whose scores it keeps; with the config's every
2nd block recomputed that is 69 GiB per rank, over the default budget (the GPU's fused kernel keeps no scores)."""
EXPERT_WEIGHTS = ("layers.*.moe.experts.w1", "layers.*.moe.experts.w2", "layers.*.moe.experts.w3")


def plan(*flags: str) -> dict:
    return make_plan(parse_args(list(flags)))


def count(p: dict, kind: str) -> float:
    return p["predicted"]["communication"].get(kind, {"count": 0})["count"]


@pytest.mark.parametrize("score_before_experts", [False, True])
def test_routed_experts_op_sends_every_pair_through_its_expert(score_before_experts):
    torch.manual_seed(0)
    tokens, dim, hidden, experts, top_k = 16, 8, 12, 4, 2
    x = torch.randn(tokens, dim)
    w1, w3 = torch.randn(experts, hidden, dim), torch.randn(experts, hidden, dim)
    w2 = torch.randn(experts, dim, hidden)
    scores = torch.rand(tokens, top_k)
    ids = torch.rand(tokens, experts).topk(top_k, dim=1).indices
    want = torch.zeros(tokens, dim)
    for t in range(tokens):
        for k in range(top_k):
            e, s = ids[t, k], scores[t, k]
            row = x[t] * s if score_before_experts else x[t]
            y = w2[e] @ (F.silu(w1[e] @ row) * (w3[e] @ row))
            want[t] += y if score_before_experts else s * y
    got = routed_experts(x, scores, ids, w1, w2, w3, score_before_experts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_debug_on_2_ranks_gathers_small_experts_unless_ep_is_pinned():
    free = plan(*DEBUG, "--parallelism.dp_shard", "2")
    moe = free["moe"]["layers.*.moe"]
    assert moe["count"] == 5 and moe["alternatives"] == 4  # replicate, tokens, experts, hidden on one dim
    assert moe["choice"] == {"dp_shard": "tokens"} and moe["expert_parallel"] is None  # 0.5 MiB experts: gathering is cheaper
    assert all(free["params"][w]["compute"] == ["R"] for w in EXPERT_WEIGHTS)
    assert count(free, "all_to_all (forward)") == 0

    pinned = plan(*DEBUG, "--parallelism.dp_shard", "2", "--parallelism.ep", "2")
    moe = pinned["moe"]["layers.*.moe"]
    assert moe["alternatives"] == 1 and moe["expert_parallel"] == {"dim": "dp_shard", "degree": 2}
    assert all(pinned["params"][w]["compute"] == ["S0"] for w in EXPERT_WEIGHTS)
    # per MoE layer: tokens, counts and outputs forward; outputs' and tokens' gradients backward
    assert count(pinned, "all_to_all (forward)") == 3 * 5 and count(pinned, "all_to_all (backward)") == 2 * 5
    assert pinned["predicted"]["objective_s"] > free["predicted"]["objective_s"]


@pytest.mark.slow
def test_solver_chooses_expert_parallelism_for_16b_across_two_nodes():
    """16 ranks, two nodes of 8: gathering 1 GiB of experts a layer over the 40 GB/s link between the nodes outlasts
    the layer's compute, so the experts stay where they are stored and the tokens travel. (Within one node the
    gathers hide behind compute in the cost model, which then gathers the experts: the test below pins ep.)"""
    p = plan("--config", "configs/deepseek_v3_16b.toml", "--model.attention", "sdpa", "--parallelism.dp_shard", "16",
             "--training.batch_size", "16", "--parallelism.ep", "1", *FULL_AC)
    moe = p["moe"]["layers.*.moe"]
    assert moe["alternatives"] == 4 and moe["expert_parallel"] == {"dim": "dp_shard", "degree": 16}, moe
    for w in EXPERT_WEIGHTS:  # stored as computed: no gather of 1 GiB of experts per layer
        assert p["params"][w]["storage"] == p["params"][w]["compute"] == ["S0"], w
    layers = 26
    assert 3 * layers <= count(p, "all_to_all (forward)") <= 3 * layers + 1
    assert 2 * layers <= count(p, "all_to_all (backward)") <= 2 * layers + 1
    assert p["params"]["layers.*.attention.wq.weight"]["compute"] == ["R"]  # dense parts stay FSDP-like
    # the overlap rows (program.py) can leave the LP fractional: then the MIP proves the plan (solved in 1.1 s beside a
    # full test run on the 2-core CI machine)
    assert p["program"]["status"] == "optimal" and p["program"]["solve_s"] < 3, p["program"]


@pytest.mark.slow
def test_plan_16b_on_8_fake_ranks_is_fast(tmp_path):
    """The issue's command: the config pins ep 8, i.e. EP over dp_shard; the flavor's FlexAttention with
    document masks gets its declared batch-parallel strategy (no op falls back to replicated)."""
    proc = launch(["plan", "--job.dump_folder", str(tmp_path), "--config", "configs/deepseek_v3_16b.toml", "--parallelism.dp_shard", "8",
                   *FULL_AC])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layers.*.moe" in proc.stdout and "expert parallel over dp_shard, ep=8" in proc.stdout
    p = json.loads((tmp_path / "plan.json").read_text())
    assert p["moe"]["layers.*.moe"]["expert_parallel"] == {"dim": "dp_shard", "degree": 8}
    # docs/placement.md's 5.2 s, measured at load 12-17: the dense plans' documented times there are 3.7-6x
    # their times at load 3-6, which is where the suite's two xdist workers keep a 2-core machine
    assert p["program"]["total_s"] < 5.2 and p["fallbacks"] == []
    attention = [n for u in p["units"] for n in u["nodes"] if n["op"] == "flex_attention"]
    assert len(attention) == 2 and all(n["ins"] == [["S0"]] * 12 for n in attention), attention


def test_ep_pins_dp_shard_only():
    with pytest.raises(ConfigError, match=r"--parallelism.ep pins expert parallelism over dp_shard, so it must be 1 .* or dp_shard's degree 2, not 4"):
        plan(*DEBUG, "--parallelism.dp_shard", "2", "--parallelism.tp", "2", "--parallelism.ep", "4")


def test_plan_without_the_pinned_ep_is_refused(tmp_path):
    report.write(plan(*DEBUG, "--parallelism.dp_shard", "2"), str(tmp_path))
    cfg = parse_args([*DEBUG, "--compile.autoparallel", "--compile.autoparallel_plan", str(tmp_path / "plan.json"),
                      "--parallelism.dp_shard", "2", "--parallelism.ep", "2"])
    with pytest.raises(ConfigError, match=r"does not split the routed experts of layers\.\*\.moe over dp_shard"):
        validate(cfg, world_size=2, device_type="cpu")


STEPS = 5
TRAIN = [*DEBUG, "--parallelism.dp_shard", "2", "--compile.mode", "aot_fx_trace", "--training.batch_size", "4",
         "--training.seq_len", "64", "--training.steps", str(STEPS), "--metrics.progress_bar", "false"]


@pytest.mark.slow
@pytest.mark.parametrize("ep", ["1", "2"])
def test_auto_placed_deepseek_trains_like_manual(tmp_path, ep):
    """ep 1: the solver's own choice (experts gathered), solved at start-up; ep 2: expert parallelism
    from a saved plan. Each matches the manual plan with the same placements."""
    flags = [*TRAIN, "--parallelism.ep", ep]
    auto = ["--compile.autoparallel", "--compile.dump_graphs"]
    if ep == "2":
        proc = launch(["plan", "--job.dump_folder", str(tmp_path / "plan"), *flags])
        assert proc.returncode == 0, proc.stderr[-3000:]
        auto += ["--compile.autoparallel_plan", str(tmp_path / "plan" / "plan.json")]
    manual = losses(run_train(flags, tmp_path / "manual", nproc=2))
    placed = losses(run_train([*flags, *auto], tmp_path / "auto", nproc=2))
    assert len(placed) == STEPS and placed[-1] < placed[0] - 1.0, placed
    for a, m in zip(placed, manual):
        assert abs(a - m) <= 1e-5, (placed, manual)
    summary = json.loads((tmp_path / "auto" / "graphs" / "summary.json").read_text())
    a2a = summary["stages"][0]["collectives"].get("all_to_all", {"count": 0})["count"]
    assert a2a == (25 if ep == "2" else 0)  # 5 MoE layers x (3 forward + 2 backward) under EP


def test_dispatch_kernel_count_is_the_traced_one():
    """moe.DISPATCH_KERNELS prices each non-GEMM kernel of the routed experts at the per-kernel floor:
    it must be what the dispatch (forward and backward) runs, counted on its traced graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.autoparallel.moe import DISPATCH_GEMMS, DISPATCH_KERNELS
    from graph_trainer.parallel.moe_dispatch import DispatchPlan, dispatch_and_combine

    def step(x, scores, ids, w1, w2, w3):
        out = dispatch_and_combine(DispatchPlan(4, 2, None, 0.0, False), x, scores, ids, w1, w2, w3).output
        return torch.autograd.grad(out.sum(), (x, scores, w1, w2, w3))

    weights = [torch.randn(4, 12, 8, requires_grad=True), torch.randn(4, 8, 12, requires_grad=True),
               torch.randn(4, 12, 8, requires_grad=True)]
    x, scores = torch.randn(16, 8, requires_grad=True), torch.rand(16, 2, requires_grad=True)
    gm = make_fx(step)(x, scores, torch.randint(0, 4, (16, 2)), *weights)
    kernels = [n.target for n in gm.graph.nodes
               if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and not n.target.is_view]
    # the harness adds two: `out.sum()` and the ones its gradient starts from
    assert len(kernels) - 2 == DISPATCH_KERNELS
    assert sum(1 for k in kernels if "grouped_mm" in str(k)) == DISPATCH_GEMMS
