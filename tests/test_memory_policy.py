"""Memory policy per activation (`--activation_checkpoint.mode memory_budget`, and op-level selective
AC in aot_fx_trace): recomputation leaves every loss and gradient norm bit for bit as without it, the
budget holds on a graph whose activations are counted by hand, the cheap activations go first, op-level
SAC in the traced step equals eager op-level SAC, and refused combinations exit 2 with one line.
"""

from __future__ import annotations

import json
import operator

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from helpers import cached_run, grad_norms, losses
from graph_trainer import cli
from graph_trainer.hardware import hardware_for
from graph_trainer.metrics import read_metrics
from graph_trainer.passes.cost_model import CostModel
from graph_trainer.passes.memory_policy import Activations, plan_memory_budget, recompute_in_backward

SMALL = ("--training.steps", "2", "--training.batch_size", "2", "--training.seq_len", "64")
PARAMS_GIB = 6_163_712 * 4 / 2**30
"""The debug model's fp32 parameters; the step keeps 4x that (parameters, gradients, two AdamW moments)."""


def _policy_dump(folder) -> str:
    (path,) = (folder / "graphs").glob("*_memory_policy.py")
    return path.read_text()


def _budget_flags(extra_gib: float) -> tuple[str, ...]:
    budget = f"{4 * PARAMS_GIB + extra_gib:.6f}GiB"
    return ("--compile.dump_graphs", "--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", budget)


def traced(*flags: str) -> list[dict]:
    return read_metrics(cached_run(("--compile.mode", "aot_fx_trace", *SMALL, *flags)))


# --- bitwise: recomputation repeats the same ops on the same inputs --------------------------------------

@pytest.mark.parametrize("extra_gib", [0.006, 0.0005])
def test_memory_budget_losses_bitwise_equal_no_ac_and_budget_holds(extra_gib):
    """A budget just over what parameters, gradients and optimizer state take leaves `extra_gib` for the
    debug model's 0.018 GiB of activations: about a third, then so little that most are recomputed."""
    ref = traced()
    run = traced(*_budget_flags(extra_gib))
    assert losses(run) == losses(ref)
    assert grad_norms(run) == grad_norms(ref)
    first = run[0]
    assert first["ac_budget_gib"] == pytest.approx(extra_gib, abs=1e-6)
    assert first["ac_saved_gib"] <= first["ac_budget_gib"]
    assert first["ac_recomputed_gib"] > 0 and first["ac_offloaded_gib"] == 0
    if extra_gib < 0.001:
        assert first["ac_saved_gib"] < 0.1 * first["ac_baseline_gib"]


def test_policy_is_in_the_graph_dump_and_summary():
    folder = cached_run(("--compile.mode", "aot_fx_trace", *SMALL, *_budget_flags(0.006)))
    stages = {s["stage"]: s for s in json.loads((folder / "graphs" / "summary.json").read_text())["stages"]}
    first = read_metrics(folder)[0]
    assert stages["memory_policy"]["report"]["ac_saved_gib"] == first["ac_saved_gib"]
    assert stages["memory_policy"]["report"]["ac_recomputed_gib"] == first["ac_recomputed_gib"]
    code = _policy_dump(folder)
    recomputed = [line for line in code.splitlines() if line.strip().startswith("recompute_")]
    assert recomputed and "recompute_" not in (folder / "graphs" / "00_traced.py").read_text()


def test_aot_memory_budget_bitwise_and_reported():
    """aot: the min-cut partitioner under its memory budget knob, set from ours (the reference is the
    aot_fx_trace run without AC: both modes equal eager bit for bit)."""
    ref = traced()
    run = read_metrics(cached_run(("--compile.mode", "aot", *SMALL, *_budget_flags(0.006))))
    assert losses(run) == losses(ref) and grad_norms(run) == grad_norms(ref)
    assert 0 < run[0]["ac_partitioner_budget"] < 1
    assert run[0]["ac_saved_gib"] <= run[0]["ac_budget_gib"]


# --- op-level selective AC in the one train-step graph --------------------------------------------------

def test_op_sac_in_aot_fx_trace_equals_eager_op_sac():
    op = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
    eager = read_metrics(cached_run(("--compile.mode", "eager", *SMALL, *op)))
    folder = cached_run(("--compile.mode", "aot_fx_trace", *SMALL, "--compile.dump_graphs", *op))
    run = read_metrics(folder)
    assert losses(run) == losses(eager) and grad_norms(run) == grad_norms(eager)
    # torchtitan's op list saves the 1st, 3rd, 5th and 7th matmul of each block and recomputes the
    # other three: the debug model's 6 blocks recompute 18 matmuls.
    code = _policy_dump(folder)
    mms = [line for line in code.splitlines() if line.strip().startswith("recompute_") and "torch.ops.aten.mm.default" in line]
    assert len(mms) == 18
    assert run[0]["ac_saved_gib"] < run[0]["ac_baseline_gib"]


# --- the budget on a graph whose activations are counted by hand ----------------------------------------

B, D = 128, 256
ACT = B * D * 4
"""Bytes of one activation of the MLP below (fp32 [128, 256])."""
LOSS = 4
"""The fp32 loss, which backward reads too (autograd seeds its gradient with `ones_like(loss)`)."""


def _mlp_step(w1, w2, w3, x):
    """mm -> gelu -> mm -> gelu -> mm -> sum. Backward keeps h1 and h2 (gelu's backward reads its input)
    and g1 and g2 (the next matmul's weight gradient reads them): four activations. g1 and g2 are
    cheap to recompute (one gelu each from h1/h2, kept anyway); h1 and h2 take a matmul."""
    h1 = x @ w1
    g1 = torch.nn.functional.gelu(h1)
    h2 = g1 @ w2
    g2 = torch.nn.functional.gelu(h2)
    loss = (g2 @ w3).sum()
    return (loss, *torch.autograd.grad(loss, [w1, w2, w3]))


def _traced_mlp() -> tuple[fx.GraphModule, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(D, D, generator=gen).div_(16).requires_grad_() for _ in range(3)]
    x = torch.randn(B, D, generator=gen)
    return make_fx(_mlp_step)(*ws, x), [*ws, x]


def _held_across_loss(gm: fx.GraphModule) -> int:
    """Bytes of values computed before the loss and read after it, counted from the graph alone:
    each op that owns its output storage (not a view of another value, not a parameter)."""
    order = list(gm.graph.nodes)
    loss_at = order.index(order[-1].args[0][0])
    total = 0
    for node in order[: loss_at + 1]:
        if node.op != "call_function" or node.target is operator.getitem or getattr(node.target, "is_view", False):
            continue
        if any(order.index(u) > loss_at for u in node.users if u.op != "output"):
            total += node.meta["val"].numel() * node.meta["val"].element_size()
    return total


def _plan(budget: int):
    gm, args = _traced_mlp()
    acts = Activations(gm, {gm.graph.find_nodes(op="placeholder")[-1]})
    policy = plan_memory_budget(acts, budget, CostModel(hardware_for(torch.device("cpu"))).node_time)
    chosen = sorted(str(n.target) for n in policy.recompute)
    expected = gm(*args)
    recompute_in_backward(gm, acts, policy.recompute)
    return gm, args, policy, chosen, expected


def test_synthetic_baseline_counts_four_activations():
    gm, _ = _traced_mlp()
    assert _held_across_loss(gm) == 4 * ACT + LOSS
    acts = Activations(gm, {gm.graph.find_nodes(op="placeholder")[-1]})
    assert plan_memory_budget(acts, 4 * ACT + LOSS, lambda n: 1.0).saved_bytes == 4 * ACT + LOSS


@pytest.mark.parametrize("budget_acts, cheap_only", [(3, True), (2, True), (1, False), (0, False)])
def test_synthetic_budget_holds_and_cheap_activations_go_first(budget_acts, cheap_only):
    gm, args, policy, chosen, expected = _plan(budget_acts * ACT + (LOSS if budget_acts else 0))
    held = _held_across_loss(gm)
    assert held == policy.saved_bytes <= budget_acts * ACT + (LOSS if budget_acts else 0)
    if cheap_only:
        # Freeing one or two activations: the gelu outputs, recomputed from the kept matmul outputs.
        assert chosen == ["aten.gelu.default"] * (4 - budget_acts)
    else:
        assert "aten.mm.default" in chosen
    got = gm(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


# --- refused combinations: exit 2, one line naming the fix ----------------------------------------------

@pytest.mark.parametrize("flags, needle", [
    (["--compile.mode", "eager", "--activation_checkpoint.mode", "memory_budget"], "use --compile.mode aot or aot_fx_trace"),
    (["--compile.mode", "jit", "--activation_checkpoint.mode", "memory_budget"], "use --compile.mode aot or aot_fx_trace"),
    (["--compile.mode", "aot_fx_trace", "--activation_checkpoint.mode", "memory_budget",
      "--activation_checkpoint.memory_budget", "lots"], "--activation_checkpoint.memory_budget 'lots' is not a fraction"),
    (["--compile.mode", "aot_fx_trace", "--activation_checkpoint.mode", "memory_budget",
      "--activation_checkpoint.memory_budget", "1.5"], "a fraction of device memory must be in (0, 1]"),
    (["--compile.mode", "aot_fx_trace", "--activation_checkpoint.memory_budget", "20GiB"],
     "read by --activation_checkpoint.mode memory_budget only"),
    (["--compile.mode", "aot_fx_trace", "--compile.passes", "memory_policy"],
     "'memory_policy' is added by --activation_checkpoint.mode; remove it from --compile.passes"),
])
def test_refused_combinations_exit_2_with_one_line(flags, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")

    def tripwire(cfg):
        raise AssertionError("validation let this configuration through to training")

    monkeypatch.setattr("graph_trainer.trainer.run", tripwire)
    try:
        code = cli.main(["train", "--job.dump_folder", str(tmp_path), *SMALL, *flags])
    except SystemExit as e:
        code = e.code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("graph-trainer: error: ") and needle in lines[0], lines[0]
