"""The collective bucketing passes (auto_bucketing, transformer_block_bucketing, reshard_after_forward)
and their cost model.

Graph-level tests trace llama3 debugmodel's train step with dp_shard=2 in this process, on a fake
process group of 2 ranks and meta tensors (no data, no communication): the same 57 all-gathers and
57 reduce-scatters a torchrun run traces. Runs under torchrun (2 ranks, gloo) check that the bucketed
graphs train bitwise like the unbucketed one: a bucket moves and reduces every element exactly as the
per-parameter collective did (same ranks, same op, same order of the two operands).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import fx

from helpers import cached_run, grad_norms, losses, read_metrics

from graph_trainer.config import ConfigError, parse_args
from graph_trainer.graph_dump import BUCKET_META, summarize
from graph_trainer.passes.bucket_plan import block_of
from graph_trainer.hardware import CPU_GLOO, H100
from graph_trainer.passes.bucket_merge import rewrite
from graph_trainer.passes.bucket_plan import Bucket, layout, place
from graph_trainer.passes.bucketing import SCHEDULE_META, auto_bucketing
from graph_trainer.passes.bucketing_compat import ALL_GATHER, REDUCE_SCATTER, WAIT
from graph_trainer.passes.collectives import find_collectives, forward_end
from graph_trainer.passes.cost_model import CostModel, Transfer, prefix_times, simulate
from graph_trainer.passes.registry import PassContext, apply_passes

PARAMS = 57
LAYERS = 6
c10d = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def fake_pg():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def trace_llama(*flags: str, optimizer_in_graph: bool = False, param_dtype: torch.dtype = torch.float32,
                replicate: bool = False) -> tuple[fx.GraphModule, PassContext]:
    """llama3 debugmodel's train step with dp_shard=2 (`replicate`: dp_replicate=2, every parameter whole and its
    gradient all-reduced) traced on meta tensors (needs `fake_pg`); with `optimizer_in_graph`, clipping and AdamW
    traced in (capture/optimizer_in_graph.py); parameters cast to `param_dtype` before they are gathered."""
    from graph_trainer import models
    from graph_trainer.blocks import annotate_blocks
    from graph_trainer.capture.fx_trace import trace_train_step
    from graph_trainer.parallel.mesh import build_meshes, resolve_degrees
    from graph_trainer.parallel.simple_fsdp import MixedPrecision
    from graph_trainer.placement import place_model
    from graph_trainer.losses import cross_entropy
    from graph_trainer.parallel import apply_activation_checkpointing
    from graph_trainer.train_step import FunctionalTrainStep, named_buffers

    replicas, shards = (2, 1) if replicate else (1, 2)
    cfg = parse_args(["--compile.mode", "aot_fx_trace", "--parallelism.dp_replicate", str(replicas), "--parallelism.dp_shard",
                      str(shards), *flags])
    meshes = build_meshes(resolve_degrees(replicas, shards, 1, 1, 2), "cpu")
    spec = models.get_spec("llama3")
    args = spec.args_for("debugmodel", 256, cfg.model.n_layers)
    model = place_model(models.build_on_meta(spec, args, "cpu"), spec, args, meshes,
                        MixedPrecision(param_dtype, torch.float32), cfg)
    annotate_blocks(model)
    apply_activation_checkpointing(model, cfg)
    step = FunctionalTrainStep(model, cross_entropy)
    params = [p.to_local() for p in model.parameters()]
    _, buffers = named_buffers(model)
    tokens = torch.zeros(4, 256, dtype=torch.long, device="meta")
    extra = []
    if optimizer_in_graph:
        from graph_trainer.capture.optimizer_in_graph import AdamWHyper, ClipAndAdamWStep

        step = ClipAndAdamWStep(step, AdamWHyper(0.9, 0.95, 1e-8, 0.1, 1.0), ep_enabled=False)
        scalar = torch.zeros((), dtype=torch.float64, device="meta")
        extra = [torch.zeros_like(p) for p in params] * 2 + [scalar, scalar]
    gm = trace_train_step(step, params, buffers, tokens, tokens, torch.device("cpu"), extra)
    ctx = PassContext(cfg=cfg, meshes=meshes, device=torch.device("cpu"), num_params=len(params),
                      num_buffers=len(buffers), param_fqns=[s.fqn for s in step.specs])
    return gm, ctx


def counts(gm: fx.GraphModule) -> dict[str, int]:
    return {k: v["count"] for k, v in summarize(gm)["collectives"].items()}


def bucket_sizes(gm: fx.GraphModule, target) -> list[int]:
    return [n.meta.get(BUCKET_META, 1) for n in gm.graph.nodes if n.target is target]


# ---------------------------------------------------------------------------------------------
# Cost model


def test_bigger_bucket_costs_less_per_byte():
    model = CostModel(H100)
    sizes = [2**k for k in range(10, 31, 4)]
    per_byte = [model.per_byte_time("all_gather", s, 8) for s in sizes]
    assert all(a > b for a, b in zip(per_byte, per_byte[1:]))
    # one bucket beats the same bytes in separate collectives
    assert model.collective_time("reduce_scatter", 64 << 20, 8) < 64 * model.collective_time("reduce_scatter", 1 << 20, 8)


def test_saturating_bucket_has_ten_percent_latency():
    for hw in (CPU_GLOO, H100):
        model = CostModel(hw)
        size = model.saturating_bytes("all_gather", 4)
        latency = 3 * hw.intra_latency_s
        assert latency / model.collective_time("all_gather", size, 4) == pytest.approx(0.1, rel=1e-3)


def test_inter_host_link_is_slower():
    from graph_trainer.passes.cost_model import Link

    model = CostModel(H100, {"inner": Link(8, False), "outer": Link(8, True)})
    assert model.collective_time("all_gather", 1 << 30, 8, "outer") > 5 * model.collective_time("all_gather", 1 << 30, 8, "inner")
    # twice the bytes of an all-gather, one latency
    ag, ar = (model.collective_time(k, 1 << 30, 8, "inner") for k in ("all_gather", "all_reduce"))
    assert ar - ag == pytest.approx(7 / 8 * (1 << 30) / H100.intra_node_bytes_per_s)


def test_simulation_hides_comm_behind_compute_only_when_issued_early():
    prefix = prefix_times([1.0] * 10)
    early = simulate(prefix, [Transfer(issue=2, wait=6, comm_s=3.0)])
    late = simulate(prefix, [Transfer(issue=5, wait=6, comm_s=3.0)])
    assert early.exposed_comm_s == 0 and early.step_s == 10
    assert late.exposed_comm_s == pytest.approx(2.0) and late.step_s == pytest.approx(12.0)
    # one stream: the second collective queues behind the first
    queued = simulate(prefix, [Transfer(0, 9, 4.0), Transfer(1, 5, 2.0)])
    assert queued.exposed_comm_s == pytest.approx(1.0)


def test_simulation_splits_the_exposed_time_by_the_kind_waited_for():
    """A wait's stall counts for its collective's kind, also where it queued behind another kind on its communicator
    (where a profile counts the other kind: its kernel is the one running)."""
    prefix = prefix_times([1.0] * 10)
    timeline = simulate(prefix, [Transfer(0, 9, 4.0, kind="reduce_scatter"), Transfer(1, 5, 2.0, kind="all_to_all"),
                                 Transfer(8, 9, 3.5, channel="twin", kind="all_gather"), Transfer(9, 10, 2.0, kind="all_reduce")])
    # the all-to-all queues behind the reduce-scatter (done at 6, waited for at 5: 1 s); the all-gather on its own
    # communicator, issued at 9 (8 + the stall), is waited for at 10 and done at 12.5; the reduce-scatter was done at 4,
    # the all-reduce (issued at 10, done at 12) by the time compute reaches its wait (13.5)
    assert timeline.exposed_by_kind == pytest.approx({"all_to_all": 1.0, "all_gather": 2.5, "reduce_scatter": 0.0, "all_reduce": 0.0})
    assert timeline.exposed_comm_s == pytest.approx(3.5) and timeline.step_s == pytest.approx(13.5)


def test_roofline_counts_matmul_flops(fake_pg):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        gm = make_fx(lambda a, b: torch.relu(a @ b))(torch.empty(4096, 4096), torch.empty(4096, 1024))
    mm, relu = [n for n in gm.graph.nodes if n.op == "call_function"]
    model = CostModel(H100)
    # 70% of the 67 TFLOP/s fp32 peak: 0.73 ms, far above the per-kernel floor
    assert model.node_time(mm) == pytest.approx(2 * 4096 * 4096 * 1024 / (0.7 * 67e12))
    # reads and writes 16 MiB at 70% of 3.35 TB/s: 14 us, under the floor, which it costs instead
    assert 2 * 4096 * 1024 * 4 / (0.7 * 3.35e12) < H100.launch_s and model.node_time(relu) == H100.launch_s


# ---------------------------------------------------------------------------------------------
# The scheduler on a small graph


def _two_layer_graph(group: str) -> fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(w1, w2, x):
        a = c10d.wait_tensor(c10d.all_gather_into_tensor(w1, 2, group))
        h = torch.relu(x @ a)
        b = c10d.wait_tensor(c10d.all_gather_into_tensor(w2, 2, group))
        y = h @ b
        g2 = c10d.wait_tensor(c10d.reduce_scatter_tensor(h.t() @ y, "avg", 2, group))
        g1 = c10d.wait_tensor(c10d.reduce_scatter_tensor(x.t() @ (y @ b.t()), "avg", 2, group))
        return y.sum().detach(), g1, g2

    with FakeTensorMode():
        return make_fx(step)(torch.empty(512, 1024), torch.empty(512, 1024), torch.empty(4096, 1024))


@pytest.mark.parametrize("hw, before", [(CPU_GLOO, "relu"), (dataclasses.replace(H100, launch_s=0.0), "mm")])
def test_scheduler_moves_all_gather_before_the_compute_it_overlaps(fake_pg, hw, before):
    """The second weight's gather is traced right before its use; the scheduler issues it just early
    enough for the model's compute to hide it: behind the relu on the CPU model (its relu takes
    longer than the gather), behind the first matmul on the H100's rates without launch overhead
    (its relu is then too short)."""
    gm = _two_layer_graph(fake_pg)
    colls = find_collectives(gm)
    assert [c.kind for c in colls] == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]
    model = CostModel(hw)
    lay = layout(gm, colls, model)
    buckets = [Bucket([c]) for c in colls]
    place(buckets, lay, model)
    second = buckets[1]
    assert lay.prefix[second.need] - lay.prefix[second.issue] >= model.collective_time("all_gather", second.nbytes, 2)
    rewrite(gm, buckets, lay)
    order = [n.target for n in gm.graph.nodes]
    second_gather = [i for i, t in enumerate(order) if t is ALL_GATHER][1]
    first_mm, relu = order.index(torch.ops.aten.mm.default), order.index(torch.ops.aten.relu.default)
    if before == "relu":
        assert first_mm < second_gather < relu
    else:
        assert second_gather < first_mm


def test_merged_collectives_keep_shapes_and_carry_bucket_size(fake_pg):
    gm = _two_layer_graph(fake_pg)
    colls = find_collectives(gm)
    model = CostModel(CPU_GLOO)
    lay = layout(gm, colls, model)
    buckets = [Bucket(colls[:2]), Bucket(colls[2:])]
    place(buckets, lay, model)
    rewrite(gm, buckets, lay)
    assert bucket_sizes(gm, ALL_GATHER) == [2] and bucket_sizes(gm, REDUCE_SCATTER) == [2]
    (ag,) = [n for n in gm.graph.nodes if n.target is ALL_GATHER]
    assert ag.meta["val"].shape == (2 * 2 * 512 * 1024,)
    out = list(gm.graph.nodes)[-1].args[0]
    assert [o.meta["val"].shape for o in out[1:]] == [(512, 1024), (512, 1024)]


# ---------------------------------------------------------------------------------------------
# llama3 debugmodel's traced train step


def test_traced_step_has_one_collective_per_parameter(fake_pg):
    gm, ctx = trace_llama()
    assert counts(gm) == {"all_gather": PARAMS, "reduce_scatter": PARAMS}
    assert len(find_collectives(gm)) == 2 * PARAMS


def test_auto_bucketing_buckets_and_prefetches(fake_pg):
    gm, ctx = trace_llama()
    gm = auto_bucketing(gm, ctx)
    got = counts(gm)
    assert got["all_gather"] < PARAMS and got["reduce_scatter"] < PARAMS
    assert sum(bucket_sizes(gm, ALL_GATHER)) == PARAMS and sum(bucket_sizes(gm, REDUCE_SCATTER)) == PARAMS
    plan = gm.meta[SCHEDULE_META]
    assert plan["estimated_exposed_comm_s"] < plan["unscheduled_exposed_comm_s"]
    # every all-gather is issued ahead of the node that first uses it
    assert all(lead > 0 for lead in plan["issue_lead_positions"])


def test_block_of():
    assert block_of("layers.3.attention.wq.weight") == 3
    assert block_of("model.layers.12._checkpoint_wrapped_module.ffn.w1.weight") == 12
    assert block_of("tok_embeddings.weight") is None and block_of("norm.weight") is None
    assert block_of("extra_layers.1.weight") is None


def test_transformer_block_bucketing_one_bucket_per_block(fake_pg):
    gm, ctx = trace_llama("--parallelism.reshard_after_forward", "never")
    gm = apply_passes(gm, ["reshard_after_forward", "transformer_block_bucketing"], ctx, "train_step")
    # 6 blocks; non-block parameters: [tok_embeddings] before the blocks, [norm, output] after them.
    assert counts(gm) == {"all_gather": LAYERS + 2, "reduce_scatter": LAYERS + 2}
    assert sorted(bucket_sizes(gm, ALL_GATHER)) == [1, 2, *[9] * LAYERS]
    assert sorted(bucket_sizes(gm, REDUCE_SCATTER)) == [1, 2, *[9] * LAYERS]
    # prefetch: block i+1's gather is issued before block i's gather is waited for
    order = list(gm.graph.nodes)
    starts = [i for i, n in enumerate(order) if n.target is ALL_GATHER]
    waits = [i for i, n in enumerate(order) if n.target is WAIT and n.args[0].target is ALL_GATHER]
    assert all(start_next < wait for start_next, wait in zip(starts[1:], waits))


def test_under_a_memory_budget_reductions_outside_the_blocks_are_buckets_of_one(fake_pg):
    """Where the step runs under a memory budget, the final norm's and the output projection's gradients are reduced
    apart: in one bucket, the output projection's fp32 gradient is copied beside itself (the 8B step's peak). Without
    a budget they share a bucket (fewer distinct pieces to compile: the test above)."""
    gm, ctx = trace_llama("--parallelism.reshard_after_forward", "never", "--activation_checkpoint.mode", "memory_budget")
    gm = apply_passes(gm, ["reshard_after_forward", "transformer_block_bucketing"], ctx, "train_step")
    assert counts(gm) == {"all_gather": LAYERS + 2, "reduce_scatter": LAYERS + 3}
    assert sorted(bucket_sizes(gm, REDUCE_SCATTER)) == [1, 1, 1, *[9] * LAYERS]


def test_a_blocks_all_reduce_does_not_cut_its_reduce_scatter_short():
    """Each block's reduce-scatter (sharded gradients) and all-reduce (replicated ones: the norms auto placement keeps
    whole) are ready together; each is waited for where the next block's reduction of its own kind is issued. Waited for
    at the next reduction of any kind, the reduce-scatter waited right after the block's own all-reduce: 28 ms of an
    auto-placed 8B-16L step's reduce-scatters exposed on 2 H200s."""
    from types import SimpleNamespace

    from graph_trainer.passes.bucket_plan import place_per_block

    buckets = [Bucket([SimpleNamespace(kind=kind, ready=ready, need=1000, nbytes=1)], block=ready // 100)
               for ready in (100, 200, 300) for kind in ("reduce_scatter", "all_reduce")]
    place_per_block(buckets)
    for kind in ("reduce_scatter", "all_reduce"):
        assert [(b.issue, b.wait) for b in buckets if b.kind == kind] == [(100, 200), (200, 300), (300, 1000)], kind


def test_a_reduction_outside_the_blocks_is_waited_for_when_the_model_expects_it_done():
    """Given the model (under a memory budget: `bucket_plan.frees_early`), the output projection's gradient bucket,
    issued before the first backward block, is waited for where the cost model expects its reduce-scatter done, inside
    that block (its buffer is freed there, where the step peaks), not when the block's own reduce-scatter is issued at
    the block's end; the blocks' reductions keep that rule (a wait that moves inside a block makes it a piece of its
    own to compile)."""
    from types import SimpleNamespace

    from graph_trainer.passes.bucket_plan import Layout, _comm_time, place_per_block

    step_s = 1e-5
    lay = Layout(order=[None] * 1001, prefix=[i * step_s for i in range(1001)], stable=list(range(1001)))
    model = CostModel(H100)

    def bucket(ready: int, block: int | None) -> Bucket:
        member = SimpleNamespace(kind="reduce_scatter", ready=ready, need=1000, nbytes=64 << 20, group_size=2, group_name="0")
        return Bucket([member], block=block)

    output, *blocks = [bucket(100, None), bucket(400, 15), bucket(700, 14)]
    place_per_block([output, *blocks], 1, lay, model)
    done = 100 + math.ceil(_comm_time(output, model) / step_s - 1e-9)
    assert 100 < done < 400 and output.wait == done
    assert [(b.issue, b.wait) for b in blocks] == [(400, 700), (700, 1000)]


def test_in_graph_optimizer_gradients_are_bucketed_per_block(fake_pg):
    """The in-graph optimizer reads every gradient (the norm, then its update): no gradient reaches the outputs,
    so the update's mark on its reader names the parameter, and the reduce-scatters are bucketed per block as
    without the optimizer, each wait before the first read."""
    gm, ctx = trace_llama("--parallelism.reshard_after_forward", "never", optimizer_in_graph=True)
    assert counts(gm)["reduce_scatter"] == len(ctx.param_fqns)
    gm = apply_passes(gm, ["reshard_after_forward", "transformer_block_bucketing"], ctx, "train_step")
    assert counts(gm) == {"all_gather": LAYERS + 2, "reduce_scatter": LAYERS + 2, "all_reduce": 1}
    assert sorted(bucket_sizes(gm, REDUCE_SCATTER)) == [1, 2, *[9] * LAYERS]
    order = list(gm.graph.nodes)
    norm = next(i for i, n in enumerate(order) if "norm" in str(n.target) and "foreach" in str(n.target))
    waits = [i for i, n in enumerate(order) if n.target is WAIT and n.args[0].target is REDUCE_SCATTER]
    assert len(waits) == LAYERS + 2 and max(waits) < norm


def test_in_graph_optimizer_all_reduces_of_replicated_gradients_are_bucketed_per_block(fake_pg):
    """Replicated parameters' gradients (here every one: dp_replicate 2) are all-reduced and then read by the in-graph
    update, as the reduce-scatters are: bucketed per block, each waited for before the gradient norm reads it, where
    each was waited for as soon as it was issued."""
    gm, ctx = trace_llama(optimizer_in_graph=True, replicate=True)
    assert counts(gm) == {"all_reduce": PARAMS}
    gm = apply_passes(gm, ["transformer_block_bucketing"], ctx, "train_step")
    assert sorted(bucket_sizes(gm, c10d.all_reduce.default)) == [1, 2, *[9] * LAYERS]
    order = list(gm.graph.nodes)
    norm = next(i for i, n in enumerate(order) if "norm" in str(n.target) and "foreach" in str(n.target))
    issued = {n: i for i, n in enumerate(order) if n.target is c10d.all_reduce.default}
    waits = {n.args[0]: i for i, n in enumerate(order) if n.target is WAIT and n.args[0] in issued}
    assert len(waits) == LAYERS + 2 and max(waits.values()) < norm
    # each block's bucket is in flight while the next block's backward computes, not waited for where it is issued
    # (the last block's, first in the embedding's reduction, which is ready right after it)
    assert sum(waits[n] - issued[n] > 100 for n in issued if n.meta.get(BUCKET_META) == 9) == LAYERS - 1


def _gathered_alive_across_loss(gm: fx.GraphModule) -> int:
    """Bytes of parameters gathered for forward (waited for before the loss) that backward reads, so
    they live across the loss. (A backward gather prefetched during the loss is not one of them.)"""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    boundary = forward_end(gm)
    alive = 0
    for wait in (n for n in gm.graph.nodes if n.target is WAIT and n.args[0].target is ALL_GATHER and pos[n] < boundary):
        ag = wait.args[0]
        derived, frontier = set(), [wait]
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if user.op == "call_function" and len(user.all_input_nodes) == 1 and user not in derived:
                    derived.add(user)
                    frontier.append(user)
        if any(pos[u] > boundary for d in derived for u in d.users):
            alive += ag.meta["val"].numel() * ag.meta["val"].element_size()
    return alive


def test_reshard_after_forward_gathers_again_for_backward(fake_pg):
    gm, ctx = trace_llama("--parallelism.reshard_after_forward", "always")
    gathered = sum(n.meta["val"].numel() * 4 for n in gm.graph.nodes if n.target is ALL_GATHER)
    embedding = 2048 * 256 * 4
    # every parameter but the embedding (its gradient does not read it) is read again in backward
    assert _gathered_alive_across_loss(gm) == gathered - embedding
    gm = apply_passes(gm, ["reshard_after_forward"], ctx, "train_step")
    assert _gathered_alive_across_loss(gm) == 0
    assert counts(gm) == {"all_gather": 2 * PARAMS - 1, "reduce_scatter": PARAMS}
    # idempotent, and off with `never`
    assert counts(apply_passes(gm, ["reshard_after_forward"], ctx, "train_step")) == counts(gm)
    gm2, ctx2 = trace_llama("--parallelism.reshard_after_forward", "never")
    assert counts(apply_passes(gm2, ["reshard_after_forward"], ctx2, "train_step"))["all_gather"] == PARAMS


def test_reshard_then_block_bucketing_buckets_backward_gathers_per_block(fake_pg):
    gm, ctx = trace_llama("--parallelism.reshard_after_forward", "always")
    gm = apply_passes(gm, ["reshard_after_forward", "transformer_block_bucketing"], ctx, "train_step")
    # forward: 6 blocks + [tok_embeddings] + [norm, output]; backward: 6 blocks + [norm, output]
    assert counts(gm) == {"all_gather": 2 * LAYERS + 3, "reduce_scatter": LAYERS + 2}
    assert _gathered_alive_across_loss(gm) == 0


@pytest.mark.parametrize("passes, backend, message", [
    (["auto_bucketing", "transformer_block_bucketing"], "none", "conflicts with"),
    (["auto_bucketing"], "autoparallel_backend", "cannot run with --compile.inductor_compilation autoparallel_backend"),
])
def test_validator_refuses_two_schedulers(passes, backend, message):
    from graph_trainer.passes.validate import check_passes

    cfg = parse_args(["--compile.mode", "aot_fx_trace", "--compile.passes", ",".join(passes),
                      "--compile.inductor_compilation", backend])
    with pytest.raises(ConfigError, match=message):
        check_passes(cfg, "cpu")


# ---------------------------------------------------------------------------------------------
# Training under torchrun: bitwise parity with the unbucketed graph

RUN = ("--training.steps", "3", "--training.batch_size", "4", "--training.seq_len", "64", "--metrics.log_freq", "1",
       "--parallelism.dp_shard", "2", "--compile.mode", "aot_fx_trace", "--compile.dump_graphs")


def _stage(folder: Path, name: str) -> dict:
    stages = json.loads((folder / "graphs" / "summary.json").read_text())["stages"]
    return next(s for s in stages if s["stage"] == name)


def test_auto_bucketing_trains_bitwise_like_unbucketed():
    base = cached_run(RUN, 2)
    folder = cached_run((*RUN, "--compile.passes", "auto_bucketing"), 2)
    assert {k: v["count"] for k, v in _stage(base, "traced")["collectives"].items()} == {"all_gather": PARAMS, "reduce_scatter": PARAMS}
    bucketed = _stage(folder, "auto_bucketing")["collectives"]
    assert bucketed["all_gather"]["count"] < PARAMS and bucketed["reduce_scatter"]["count"] < PARAMS
    assert bucketed["all_gather"]["buckets"] > 0 and bucketed["reduce_scatter"]["buckets"] > 0
    ref, got = read_metrics(base), read_metrics(folder)
    assert len(got) == 3
    assert losses(got) == losses(ref) and grad_norms(got) == grad_norms(ref)


@pytest.mark.slow
def test_reshard_and_block_bucketing_train_bitwise_like_unbucketed():
    base = cached_run(RUN, 2)
    folder = cached_run((*RUN, "--parallelism.reshard_after_forward", "always", "--compile.passes", "transformer_block_bucketing"), 2)
    got = _stage(folder, "transformer_block_bucketing")["collectives"]
    assert {k: v["count"] for k, v in got.items()} == {"all_gather": 2 * LAYERS + 3, "reduce_scatter": LAYERS + 2}
    ref, run = read_metrics(base), read_metrics(folder)
    assert losses(run) == losses(ref) and grad_norms(run) == grad_norms(ref)


def test_replicated_gradients_all_reduced_per_block_bitwise():
    """Data parallelism without sharding (dp_replicate 2): every gradient is all-reduced, one collective per
    parameter as traced; the block schedule reduces them in one all-reduce per block, [norm, output] and
    [tok_embeddings] their own (as the solver prices a replicated parameter's gradient: one latency per
    block). Two ranks sum each element in one addition, however the ring splits the buffer: bitwise."""
    ddp = (*RUN, "--parallelism.dp_shard", "1", "--parallelism.dp_replicate", "2")
    base = cached_run((*ddp, "--compile.passes", "none"), 2)
    folder = cached_run((*ddp, "--compile.passes", "transformer_block_bucketing"), 2)
    assert {k: v["count"] for k, v in _stage(base, "traced")["collectives"].items()} == {"all_reduce": PARAMS}
    got = _stage(folder, "transformer_block_bucketing")["collectives"]
    assert {k: (v["count"], v["buckets"]) for k, v in got.items()} == {"all_reduce": (LAYERS + 2, LAYERS + 1)}
    ref, run = read_metrics(base), read_metrics(folder)
    assert len(run) == 3 and losses(run) == losses(ref) and grad_norms(run) == grad_norms(ref)


@pytest.mark.slow
def test_replicated_gradients_read_by_the_in_graph_update_all_reduced_per_block_bitwise():
    """The same with the optimizer in the graph, whose update reads each all-reduced gradient: one all-reduce per block,
    bitwise the step that reduces them one by one."""
    ddp = (*RUN, "--parallelism.dp_shard", "1", "--parallelism.dp_replicate", "2", "--compile.optimizer_in_graph")
    base = cached_run((*ddp, "--compile.passes", "none"), 2)
    folder = cached_run((*ddp, "--compile.passes", "transformer_block_bucketing"), 2)
    got = _stage(folder, "transformer_block_bucketing")["collectives"]
    assert got["all_reduce"]["count"] == LAYERS + 2
    ref, run = read_metrics(base), read_metrics(folder)
    assert len(run) == 3 and losses(run) == losses(ref) and grad_norms(run) == grad_norms(ref)


@pytest.mark.slow
@pytest.mark.parametrize("mode, stage", [("aot", "joint_auto_bucketing"), ("jit", "backward_auto_bucketing")])
def test_auto_bucketing_in_aot_and_jit_trains_bitwise_like_unbucketed(mode, stage):
    base = cached_run(RUN, 2)
    args = [a if a != "aot_fx_trace" else mode for a in RUN]
    folder = cached_run((*args, "--compile.passes", "auto_bucketing"), 2)
    got = _stage(folder, stage)["collectives"]
    assert got["reduce_scatter"]["count"] < PARAMS and got["reduce_scatter"]["buckets"] > 0
    ref, run = read_metrics(base), read_metrics(folder)
    assert losses(run) == losses(ref) and grad_norms(run) == grad_norms(ref)


# ---------------------------------------------------------------------------------------------
# The default schedule of a multi-rank traced step: 4 gloo ranks, 4 blocks

FOUR = ("--parallelism.dp_shard", "4", "--model.n_layers", "4", "--training.steps", "2", "--training.batch_size", "4",
        "--training.seq_len", "64", "--metrics.log_freq", "1", "--compile.dump_graphs")
_CALL = re.compile(r"= torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor|wait_tensor)\.default\((\w+)(?:, [^,]+)*?(?:, '(\w+)')?\)")


def _calls(code: str) -> list[tuple[str, str, str | None]]:
    """(op, first argument, group name) of each collective and wait, in graph order."""
    return [(m.group(1), m.group(2), m.group(3)) for m in _CALL.finditer(code)]


@pytest.mark.slow
def test_default_schedule_on_four_ranks_buckets_per_block_on_its_own_group_bitwise():
    folder = cached_run(FOUR, 4)
    plain = cached_run((*FOUR, "--compile.passes", "none"), 4)
    stages = [s["stage"] for s in json.loads((folder / "graphs" / "summary.json").read_text())["stages"]]
    assert stages == ["traced", "reshard_after_forward", "recompute_pointwise", "separate_gather_group", "transformer_block_bucketing"]
    got = _stage(folder, "transformer_block_bucketing")["collectives"]
    # all-gathers: forward [tok_embeddings], 4 blocks, [norm, output]; backward gathers again the 4 blocks
    # reshard_after_forward freed. Reduce-scatters: 4 blocks, [tok_embeddings], [norm, output].
    assert (got["all_gather"]["count"], got["all_gather"]["buckets"]) == (10, 9)
    assert (got["reduce_scatter"]["count"], got["reduce_scatter"]["buckets"]) == (6, 5)
    calls = _calls(next((folder / "graphs").glob("*_transformer_block_bucketing.py")).read_text())
    gather_groups = {g for op, _, g in calls if op == "all_gather_into_tensor"}
    scatter_groups = {g for op, _, g in calls if op == "reduce_scatter_tensor"}
    assert len(gather_groups) == 1 and len(scatter_groups) == 1 and gather_groups != scatter_groups
    # prefetch: every forward block's all-gather is in flight before the previous one is waited for
    issued = [i for i, (op, _, _) in enumerate(calls) if op == "all_gather_into_tensor"]
    waited = [i for i, (op, arg, _) in enumerate(calls) if op == "wait_tensor" and arg.startswith("all_gather")]
    assert all(nxt < wait for nxt, wait in zip(issued[1:6], waited[:5]))
    record = read_metrics(folder)[0]
    assert record["gathers_on_own_group"] > 0 and 1 <= record["prefetch_blocks"] <= 3
    ref, run = read_metrics(plain), read_metrics(folder)
    assert losses(run) == losses(ref) and grad_norms(run) == grad_norms(ref)


def test_the_simulated_peak_of_the_scheduled_step_counts_its_buckets(fake_pg):
    """`memory_policy.step_peak_bytes` simulates the step as the compiler gets it: the per-block schedule's prefetched
    gathers and bucket copies hold memory the unscheduled graph does not (`bench/predict_on_meta.py` prints it for a
    GPU job, docs/memory.md)."""
    from graph_trainer.passes.memory_policy import step_peak_bytes

    gm, ctx = trace_llama("--parallelism.reshard_after_forward", "always")
    gm = apply_passes(gm, ["reshard_after_forward"], ctx, "train_step")
    before = step_peak_bytes(gm, ctx)
    gm = apply_passes(gm, ["transformer_block_bucketing"], ctx, "train_step")
    assert step_peak_bytes(gm, ctx) > before
