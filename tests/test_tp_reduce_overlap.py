"""tp_reduce_overlap: the ops before a tensor-parallel reduce-scatter that its input does not need run after its issue.

Graph test: llama3's debug model traced at tp 2 on a fake process group (as test_async_tp.py). On gloo (tp 2, 2 ranks)
the step with the pass trains bit for bit like the step without it: a reorder of the same ops."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from helpers import cached_run, grad_norms, losses, read_metrics
from test_async_tp import LAYERS, TP2, _llama, fake_pg  # noqa: F401  (fake_pg is a fixture)

from graph_trainer.passes.async_tp import PIPELINED, async_tp, tp_group
from graph_trainer.passes.bucketing_compat import REDUCE_SCATTER, WAIT
from graph_trainer.passes.tp_reduce_overlap import tp_reduce_overlap

aten = torch.ops.aten


def _between(gm: fx.GraphModule, group: str) -> list[list[fx.Node]]:
    """For each plain TP reduce-scatter (not one of async_tp's slices), the matmuls between its issue and its wait."""
    order = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    found = []
    for node in order:
        if node.target is REDUCE_SCATTER and node.args[3] == group and PIPELINED not in node.meta:
            wait = next(u for u in node.users if u.target is WAIT)
            found.append([n for n in order[pos[node] + 1 : pos[wait]] if n.target is aten.mm.default])
    return found


def test_weight_gradients_run_beside_the_reduce_scatters_async_tp_leaves(fake_pg):
    gm, ctx = _llama(1, 2)
    async_tp(gm, ctx)
    group = tp_group(ctx)
    params = {tuple(p.meta["val"].shape) for p in gm.graph.find_nodes(op="placeholder")[: ctx.num_params]}
    before = _between(gm, group)
    # what async_tp leaves, each waited for at once: the token embedding's output in forward (no matmul before it),
    # and each block's two column-parallel input gradients (sums of matmuls)
    assert len(before) == 2 * LAYERS + 1 and not any(before)
    tp_reduce_overlap(gm, ctx)
    after = _between(gm, group)
    # beside each block's two: the weight gradients computed since the gather before them (matmuls of a parameter's
    # shape: w2, w1, w3; wo, wq, wk, wv)
    assert len(after) == len(before) and sorted(len(mms) for mms in after) == sorted([0] + [3, 4] * LAYERS)
    assert all(tuple(mm.meta["val"].shape) in params for mms in after for mm in mms)
    report = ctx.report["tp_reduce_overlap"]
    assert report["tp_reduce_overlap_sites"] == 2 * LAYERS and report["tp_reduce_overlap_ops"] >= 5 * LAYERS


def test_graph_unchanged_without_tp(fake_pg):
    gm, ctx = _llama(2, 1)
    before = gm.code
    tp_reduce_overlap(gm, ctx)
    assert gm.code == before and ctx.report["tp_reduce_overlap"]["tp_reduce_overlap_sites"] == 0


@pytest.mark.slow
def test_two_ranks_train_bitwise_like_without():
    ref = read_metrics(cached_run((*TP2, "--compile.passes", "async_tp"), 2))
    got = read_metrics(cached_run((*TP2, "--compile.passes", "async_tp,tp_reduce_overlap"), 2))
    assert losses(got) == losses(ref) and grad_norms(got) == grad_norms(ref)
    assert got[0]["tp_reduce_overlap_sites"] == 2 * 6
