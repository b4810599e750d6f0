"""async_tp: the TP all-gathers before column-parallel matmuls and reduce-scatters after row-parallel ones,
micro-pipelined with the matmuls.

Graph tests trace llama3's debug model (2 layers) at tp 2 in this process on a fake process group; runs
on gloo (tp 2 on 2 ranks; DeepSeek V3 at dp_shard 2 x tp 2 x ep 4 on 4 ranks with ep_overlap too) train
bitwise like the runs without the pass.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import fx

from helpers import cached_run, grad_norms, losses, read_metrics
from traced_step import trace_step

from graph_trainer.passes.async_tp import PIPELINED, _lower_gather, _lower_scatter, tp_group, async_tp, tp_sites
from graph_trainer.passes.bucketing_compat import ALL_GATHER, REDUCE_SCATTER, WAIT

LAYERS = 2
aten = torch.ops.aten


@pytest.fixture(scope="module")
def fake_pg():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _llama(dp_shard: int, tp: int, batch: int = 4) -> tuple[fx.GraphModule, object]:
    return trace_step("llama3", dp_shard, tp, 1, "--model.n_layers", str(LAYERS), batch=batch)


def _overlapped(gm: fx.GraphModule, group: str) -> int:
    """TP collectives with a matmul between their issue and their wait."""
    order = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    found = 0
    for node in order:
        if node.target in (ALL_GATHER, REDUCE_SCATTER) and node.args[-1] == group:
            wait = next(u for u in node.users if u.target is WAIT)
            found += any(n.target is aten.mm.default for n in order[pos[node] + 1 : pos[wait]])
    return found


# a batch of one: DTensor gathers along dim 0 and views the result as the sequence (no split and cat), the
# layout of llama3 8B's 1 x 8192 sequences a rank (no gather was found there on 2 H200s before this pattern)
@pytest.mark.parametrize("batch", [4, 1])
def test_finds_every_tp_matmul_pair_and_pipelines_it(fake_pg, batch):
    gm, ctx = _llama(1, 2, batch)
    group = tp_group(ctx)
    gathers, scatters = tp_sites(gm, group, ctx.num_params)
    # Forward: each block gathers the input of wq/wk/wv and of w1/w3, and reduce-scatters wo's and w2's
    # output; the output layer gathers its input. Backward mirrors the row-parallel pairs (the gradient of
    # wo's and w2's input is gathered for one matmul each) and reduce-scatters the output layer's input
    # gradient; the column-parallel input gradients sum several matmuls and are not a pair.
    assert (len(gathers), len(scatters)) == (4 * LAYERS + 1, 2 * LAYERS + 1)
    assert sum(len(s.matmuls) for s in gathers) == 5 * LAYERS + 1 + 2 * LAYERS
    assert _overlapped(gm, group) == 0
    async_tp(gm, ctx)
    report = ctx.report["async_tp"]
    assert (report["async_tp_gathers"], report["async_tp_scatters"], report["async_tp_lowering"]) == (9, 5, "chunked")
    # Each pair became two collectives of half the size, one of them in flight over a chunk's matmul.
    assert _overlapped(gm, group) == len(gathers) + len(scatters)
    assert tp_sites(gm, group, ctx.num_params) == ([], [])


@pytest.mark.parametrize("batch", [4, 1])
def test_symm_mem_lowering_builds_the_fused_ops(fake_pg, batch):
    gm, ctx = _llama(1, 2, batch)
    gathers, scatters = tp_sites(gm, tp_group(ctx), ctx.num_params)
    shapes = [mm.meta["val"].shape for s in gathers for mm in s.matmuls]
    for site in gathers:
        assert _lower_gather(gm.graph, site, chunks=None)
    for site in scatters:
        _lower_scatter(gm.graph, site, chunks=None)
    gm.graph.lint()
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.symm_mem.fused_all_gather_matmul.default]
    assert len(fused) == len(gathers)
    # the fused op's outputs keep the gathered activation's leading dims: viewed back to the matmuls' shapes
    outs = [next(iter(out.users)).meta["val"].shape for n in fused for item in n.users if item.args[1] == 1
            for out in sorted(item.users, key=lambda g: g.args[1])]
    assert outs == shapes
    scattered = [n for n in gm.graph.nodes if n.target is torch.ops.symm_mem.fused_matmul_reduce_scatter.default]
    assert [n.meta["val"].shape for n in scattered] == [s.wait.meta["val"].shape for s in scatters]


def _tp_collectives(gm: fx.GraphModule, group: str) -> list[tuple[str, tuple[int, ...]]]:
    """The chunked lowering's collectives (their kind and input shape)."""
    return [("gather" if n.target is ALL_GATHER else "scatter", tuple(n.args[0].meta["val"].shape)) for n in gm.graph.nodes
            if n.target in (ALL_GATHER, REDUCE_SCATTER) and n.args[-1] == group and PIPELINED in n.meta]


def test_chunk_count_sets_the_slices(fake_pg):
    """--compile.async_tp_chunks 4: each pair's collective in four pieces of a quarter of the rank's rows (the first
    gather and the last reduce-scatter exposed, a quarter of the bytes each), every piece but the last in flight over
    a matmul."""
    two, ctx = _llama(1, 2)
    group = tp_group(ctx)
    sites = sum(map(len, tp_sites(two, group, ctx.num_params)))
    async_tp(two, ctx)
    four, ctx4 = _llama(1, 2)
    ctx4.cfg.compile.async_tp_chunks = 4
    async_tp(four, ctx4)
    halves, quarters = _tp_collectives(two, group), _tp_collectives(four, group)
    assert len(halves) == 2 * sites and len(quarters) == 4 * sites
    assert sorted((kind, 2 * math.prod(s)) for kind, s in quarters) == sorted(2 * [(kind, math.prod(s)) for kind, s in halves])
    assert _overlapped(two, group) == sites and _overlapped(four, group) == 3 * sites


def test_graph_unchanged_without_tp(fake_pg):
    gm, ctx = _llama(2, 1)
    before = gm.code
    assert tp_sites(gm, tp_group(ctx), ctx.num_params) == ([], [])
    async_tp(gm, ctx)
    assert gm.code == before
    assert ctx.report["async_tp"]["async_tp_sites_found"] == 0


def _stage(folder, name: str) -> dict:
    stages = json.loads((folder / "graphs" / "summary.json").read_text())["stages"]
    return next(s for s in stages if s["stage"] == name)


TP2 = ("--training.steps", "10", "--training.seq_len", "128", "--parallelism.dp_shard", "1", "--parallelism.tp", "2",
       "--compile.mode", "aot_fx_trace", "--compile.dump_graphs")
"""test_fx_trace.py's tp2 run (the same arguments: one cached run serves both)."""


@pytest.mark.slow
def test_two_ranks_train_bitwise_like_without():
    # Each output row is the same dot product, each reduced element the same sum over ranks: the
    # reduction order is unchanged, and fp32 CPU matmuls of fewer rows round alike.
    ref = read_metrics(cached_run(TP2, 2))
    folder = cached_run((*TP2, "--compile.passes", "async_tp"), 2)
    got = read_metrics(folder)
    assert losses(got) == losses(ref) and grad_norms(got) == grad_norms(ref)
    layers = 6
    assert (got[0]["async_tp_gathers"], got[0]["async_tp_scatters"]) == (4 * layers + 1, 2 * layers + 1)
    collectives = _stage(folder, "async_tp")["collectives"]
    assert collectives["all_gather"]["count"] == 4 * layers + 3 + 4 * layers + 1


@pytest.mark.slow
def test_batch_of_one_trains_bitwise_like_without():
    one = ("--training.steps", "3", "--training.batch_size", "1", "--metrics.log_freq", "1", "--parallelism.tp", "2",
           "--compile.mode", "aot_fx_trace")
    ref = read_metrics(cached_run(one, 2))
    got = read_metrics(cached_run((*one, "--compile.passes", "async_tp"), 2))
    assert losses(got) == losses(ref) and grad_norms(got) == grad_norms(ref)
    layers = 6
    assert (got[0]["async_tp_gathers"], got[0]["async_tp_scatters"]) == (4 * layers + 1, 2 * layers + 1)


FOUR = ("--model.name", "deepseek_v3", "--model.n_layers", "3", "--training.batch_size", "4", "--training.seq_len", "64",
        "--training.steps", "3", "--metrics.log_freq", "1", "--parallelism.dp_shard", "2", "--parallelism.tp", "2",
        "--parallelism.ep", "4")


@pytest.mark.slow
def test_four_ranks_with_ep_overlap_train_bitwise_like_the_default_schedule():
    ref = read_metrics(cached_run(FOUR, 4))
    got = read_metrics(cached_run((*FOUR, "--compile.passes",
                                   "separate_gather_group,transformer_block_bucketing,async_tp,ep_overlap"), 4))
    assert losses(got) == losses(ref) and grad_norms(got) == grad_norms(ref)
    assert got[0]["moe_chunks"] == 2 and got[0]["async_tp_gathers"] > 0 and got[0]["async_tp_scatters"] > 0
