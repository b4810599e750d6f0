"""recompute_pointwise (aot_fx_trace, on by default): SwiGLU's silu and product are recomputed in
backward from the two matmul outputs backward keeps anyway, so no block's forward silu or product is
read by backward; a value whose recomputation would need an input saved in its place (a block's
residual stream, a matmul output) stays saved; the saved bytes fall by at least those two tensors per
block; losses and gradient norms are bitwise those of the run without the pass, on one rank and on two
FSDP ranks."""

from __future__ import annotations

import pytest
import torch

from helpers import cached_train, grad_norms, losses
from test_bucketing import fake_pg, trace_llama  # noqa: F401  (fake_pg is a fixture)
from graph_trainer.blocks import node_block
from graph_trainer.graph_dump import nbytes
from graph_trainer.passes.activations import Activations
from graph_trainer.passes.recompute import Ledger
from graph_trainer.passes.registry import apply_passes

aten = torch.ops.aten
LONG = ("--compile.mode", "aot_fx_trace", "--training.steps", "3", "--training.batch_size", "4", "--training.seq_len", "256")


def _ledger(gm, ctx) -> tuple[Activations, Ledger]:
    acts = Activations.of_step(gm, ctx)
    return acts, Ledger(acts)


def _saved(gm, ctx, values) -> list[str]:
    """Those of `values` whose storage backward reads (the value or a view of it)."""
    acts, ledger = _ledger(gm, ctx)
    return [v.name for v in values if any(ledger.saved(m) for m in acts.by_root.get(v, ()))]


def test_swiglu_pointwise_values_are_recomputed_not_saved(fake_pg):
    gm, ctx = trace_llama()
    gm = apply_passes(gm, ["reshard_after_forward"], ctx, "train_step")
    nodes = list(gm.graph.nodes)
    forward_end = max(i for i, n in enumerate(nodes) if n.target is aten.nll_loss_forward.default)
    silus = [n for n in nodes[:forward_end] if n.target is aten.silu.default]
    products = [next(u for u in s.users if u.target is aten.mul.Tensor) for s in silus]
    edges = [n for n in nodes[:forward_end] if n.target is aten.add.Tensor and node_block(n) is not None
             and any(node_block(u) != node_block(n) for u in n.users)]
    layers = len({node_block(s) for s in silus})
    assert layers == len(silus) > 1 and len(edges) >= layers - 1
    assert len(_saved(gm, ctx, silus + products)) == 2 * layers, "the premise: backward reads them without the pass"
    before = _ledger(gm, ctx)[1].bytes

    gm = apply_passes(gm, ["recompute_pointwise"], ctx, "train_step")
    assert _saved(gm, ctx, silus + products) == []
    recomputed = [n for n in gm.graph.nodes if n.name.startswith("recompute_silu")]
    assert sorted(node_block(n) for n in recomputed) == sorted(node_block(s) for s in silus)
    # the residual stream stays saved: recomputing it would save the block's inputs in its place
    assert len(_saved(gm, ctx, edges)) == len(edges)
    report = ctx.report["recompute_pointwise"]
    assert report["pointwise_recomputed"] >= 2 * layers
    freed = before - _ledger(gm, ctx)[1].bytes
    assert freed >= sum(nbytes(v.meta["val"]) for v in silus + products)
    assert report["pointwise_saved_gib"] * 2**30 == pytest.approx(freed, rel=1e-12)


@pytest.mark.parametrize("nproc,mesh", [(1, ()), (2, ("--parallelism.dp_shard", "2"))])
def test_losses_bitwise_with_and_without(nproc, mesh):
    off = cached_train((*LONG, *mesh, "--activation_checkpoint.recompute_pointwise", "false"), nproc)
    on = cached_train((*LONG, *mesh), nproc)
    assert on[0]["pointwise_recomputed"] > 0 and "pointwise_recomputed" not in off[0]
    assert losses(on) == losses(off)
    assert grad_norms(on) == grad_norms(off)
