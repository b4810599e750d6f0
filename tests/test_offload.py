"""Activation offload in the memory-budget policy (`--activation_checkpoint.offload`): a run that
offloads every activation it can gives the losses and gradient norms of the run without AC bit for
bit, and its graph dump holds each activation's offload, wait, reload and wait in that order before
the first backward use; the simulated peak falls by exactly the offloaded bytes where the hand count
says so; the auto policy offloads where an H100's host link hides the copies behind compute and never
on the CPU; the ops keep their nodes through tracing and dead-code elimination.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from helpers import cached_run, grad_norms, losses
from test_bucketing import fake_pg, trace_llama  # noqa: F401  (fake_pg is a fixture)
from test_memory_policy import ACT, PEAK_NO_AC, PARAMS_GIB, _budget_flags, _mlp_step, _policy_dump, _traced_mlp, traced
from graph_trainer.hardware import CPU_GLOO, H100
from graph_trainer.units import GiB
from graph_trainer.metrics import read_metrics
from graph_trainer.passes.cost_model import CostModel
from graph_trainer.passes.liveness import graph_schedule, simulate
from graph_trainer.passes.memory_policy import Activations, Offload, offload_in_backward, plan_memory_budget
from graph_trainer.passes.registry import apply_passes
from graph_trainer.passes.offload_ops import OFFLOAD, RELOAD, WAIT_OFFLOAD, WAIT_RELOAD
from graph_trainer.passes.transfers import OFFLOADED

ALWAYS = ("--activation_checkpoint.offload", "always")


def _transfer_lines(code: str) -> dict[str, dict[str, int]]:
    """For each offloaded value of a dumped graph: the line of its offload, offload wait, reload,
    reload wait, the last line reading the value itself and the first other line reading its reload."""
    lines = code.splitlines()
    found: dict[str, dict[str, int]] = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s*offload_(\w+)\b.*graph_trainer\.offload\.default\((\w+)\)", line)
        if m:
            found[m.group(2)] = {"offload": i}
    for name, at in found.items():
        reads = lambda v, i: re.search(rf"[(, ]{v}[,)]", lines[i].split("=", 1)[-1]) is not None  # noqa: E731
        for i, line in enumerate(lines):
            if line.lstrip().startswith(f"wait_offload_{name} "):
                at["wait_offload"] = i
            elif line.lstrip().startswith(f"reload_{name}:"):
                at["reload"] = i
            elif line.lstrip().startswith(f"wait_reload_{name} "):
                at["wait_reload"] = i
            elif reads(name, i):
                at["last_read"] = i
            elif reads(f"reload_{name}", i) and "first_use" not in at:
                at["first_use"] = i
    return found


def test_offload_always_losses_bitwise_equal_no_ac_and_transfers_in_order():
    """Every activation the policy can offload goes to host memory and back (on the CPU: copies into
    separate tensors), on top of recomputation under the budget of test_memory_policy's first case."""
    ref = traced()
    folder = cached_run(("--compile.mode", "aot_fx_trace", "--training.steps", "2", "--training.batch_size", "4",
                         "--training.seq_len", "256", *_budget_flags(3 * PARAMS_GIB + 0.05), *ALWAYS))
    run = read_metrics(folder)
    assert losses(run) == losses(ref)
    assert grad_norms(run) == grad_norms(ref)
    first = run[0]
    assert first["ac_offloaded_gib"] > 0 and first["ac_recomputed_gib"] > 0
    assert first["ac_peak_gib"] <= first["ac_budget_gib"]
    # No host link on the CPU: nothing hides the copies.
    assert first["ac_offload_unhidden"] > 0
    transfers = _transfer_lines(_policy_dump(folder))
    assert transfers
    for name, at in transfers.items():
        assert at["last_read"] < at["wait_offload"] < at["reload"] < at["wait_reload"] < at["first_use"], (name, at)
        assert at["offload"] < at["wait_offload"]


@pytest.mark.parametrize("hardware", ["cpu", "h100"])
def test_rewritten_fsdp_step_has_the_simulated_peak(fake_pg, hardware):
    """llama3 debugmodel with dp_shard=2 (all-gathers and reduce-scatters in the graph), every activation
    that can be offloaded, under a budget that also needs recomputation: the liveness of the rewritten
    graph is the peak the policy simulated and reported, and each offload has its four nodes."""
    gm, ctx = trace_llama("--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", "0.1GiB",
                          "--activation_checkpoint.offload", "always", "--compile.hardware", hardware)
    gm = apply_passes(gm, ["reshard_after_forward", "memory_policy"], ctx, "train_step")
    report = ctx.report["memory_policy"]
    assert report["ac_offloaded_gib"] > 0 and report["ac_recomputed_gib"] > 0
    peak = report["ac_persistent_gib"] * GiB + simulate(graph_schedule(gm.graph.nodes)).peak
    assert peak / GiB == pytest.approx(report["ac_peak_gib"], rel=1e-12)
    added = [n.target for n in gm.graph.nodes if n.meta.get("memory_policy") == OFFLOADED]
    offloads = [n for n in gm.graph.nodes if n.target is OFFLOAD]
    assert sorted(added, key=str) == sorted([OFFLOAD, WAIT_OFFLOAD, RELOAD, WAIT_RELOAD] * len(offloads), key=str)
    assert sum(nbytes_of(n.args[0]) for n in offloads) / GiB == pytest.approx(report["ac_offloaded_gib"], rel=1e-12)
    # The CPU has no host link: nothing is hidden. On the H100 every op costs at least its launch floor
    # (58 us) and the debug model's activations are a few MiB (3 MiB: 70 us on the link, 160 us with
    # the launch and the margin), so a few ops cover each copy.
    assert report["ac_offload_unhidden"] == (len(offloads) if hardware == "cpu" else 0)


def nbytes_of(node: fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()


def _rewritten(roots_of, hw=CPU_GLOO):
    gm, args = _traced_mlp()
    acts = Activations(gm, {gm.graph.find_nodes(op="placeholder")[-1]})
    roots = roots_of(gm)
    with torch.no_grad():
        expected = gm(*args)
        offload_in_backward(gm, acts, roots, CostModel(hw))
        got = gm(*args)
    return gm, expected, got


def test_forced_offload_lowers_the_peak_by_its_bytes():
    """h1 (the first matmul's output, read again by the last gelu_backward) offloaded: it is off the
    device at the peak (gelu_backward of h2) and back only for its own backward use: the peak falls by
    one activation; the results stay bitwise."""
    gm, expected, got = _rewritten(lambda gm: {next(n for n in gm.graph.nodes if n.name == "mm")})
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert simulate(graph_schedule(gm.graph.nodes)).peak == PEAK_NO_AC - ACT
    added = [n for n in gm.graph.nodes if n.meta.get("memory_policy") == OFFLOADED]
    assert [n.target for n in added] == [OFFLOAD, WAIT_OFFLOAD, RELOAD, WAIT_RELOAD]
    order = list(gm.graph.nodes)
    reload = added[2]
    (use,) = [u for u in reload.users if u is not added[3]]
    assert order.index(added[3]) < order.index(use) and use.target is torch.ops.aten.gelu_backward.default


def test_ops_survive_fake_tracing_and_dead_code_elimination():
    def step(x):
        y = x * 2
        host = torch.ops.graph_trainer.offload(y)
        torch.ops.graph_trainer.wait_offload(host, y)
        back = torch.ops.graph_trainer.reload(host, x.device)
        torch.ops.graph_trainer.wait_reload(back, host)
        return back + 1

    x = torch.randn(4, 3).t()
    with FakeTensorMode() as mode:
        gm = make_fx(step, tracing_mode="fake")(mode.from_tensor(x))
    gm.graph.eliminate_dead_code()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.aten.mul.Tensor, OFFLOAD, WAIT_OFFLOAD, RELOAD, WAIT_RELOAD, torch.ops.aten.add.Tensor]
    host = next(n for n in gm.graph.nodes if n.target is OFFLOAD).meta["val"]
    assert host.device.type == "cpu" and host.stride() == (1, 3)
    real = make_fx(step)(x)
    out = real(x)
    assert torch.equal(out, x * 2 + 1) and out.stride() == x.stride()


BIG_B, BIG_D = 16384, 4096
"""The MLP at a size where an fp32 matmul (550 GFLOP: 11.7 ms on an H100's fp32 cores at 70%) hides the
copy of its 256 MiB output (7.6 ms over the host link at 45 GB/s, with the margin)."""


def _big_mlp() -> fx.GraphModule:
    with FakeTensorMode():
        ws = [torch.empty(BIG_D, BIG_D, requires_grad=True) for _ in range(3)]
        return make_fx(_mlp_step, tracing_mode="fake")(*ws, torch.empty(BIG_B, BIG_D))


@pytest.mark.parametrize("hw, offloaded, recomputed", [(H100, ["mm"], []), (CPU_GLOO, [], ["gelu"])])
def test_auto_offloads_where_the_host_link_hides_it(hw, offloaded, recomputed):
    """One byte under the peak: on an H100 the first matmul's output goes to host memory (dearer to
    recompute than the gelu, its copies hidden); on the CPU, which has no host link, the gelu is
    recomputed instead. Either way the peak falls by one activation."""
    gm = _big_mlp()
    peak = simulate(graph_schedule(gm.graph.nodes)).peak
    acts = Activations(gm, {gm.graph.find_nodes(op="placeholder")[-1]})
    policy = plan_memory_budget(acts, peak - 1, CostModel(hw).node_time, Offload("auto", hw))
    assert sorted(r.name for r in policy.offload) == offloaded
    assert sorted(n.name for n in policy.recompute) == recomputed
    assert peak - policy.peak_bytes == BIG_B * BIG_D * 4
    for t in policy.offload.values():
        assert t.exposed_s == 0 and t.start < t.wait < t.reload <= t.use


def test_regional_inductor_runs_the_transfers_between_its_regions():
    """Under `--compile.inductor_compilation regional` the transfers stay in the outer graph, between
    compiled regions: the results equal those of the same regions compiled without offload bit for bit."""
    from test_inductor_passes import Toy, annotate_regions, toy_train_step
    from graph_trainer.passes.inductor import regional_inductor_pass

    def compiled(offload: bool):
        torch.manual_seed(0)
        gm, ctx, real = toy_train_step(annotate_regions(Toy(), ("feed_forward",)))
        if offload:
            acts = Activations(gm, set(gm.graph.find_nodes(op="placeholder")[-2:]))
            offload_in_backward(gm, acts, acts.offloadable, CostModel(CPU_GLOO))
        step = regional_inductor_pass(gm, ctx)
        with torch.no_grad():
            return step.graph_module, step(*real)

    outer, got = compiled(offload=True)
    _, expected = compiled(offload=False)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    counts = {t: sum(1 for n in outer.graph.nodes if n.target is t) for t in (OFFLOAD, WAIT_OFFLOAD, RELOAD, WAIT_RELOAD)}
    assert len(set(counts.values())) == 1 and counts[OFFLOAD] > 0, counts
