"""capture/unread.py: what the traced step computes and never reads leaves the graph, a functional collective on the
way included (checkpointed blocks' recomputed outputs under tensor parallelism)."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from helpers import cached_run, grad_norms, losses, read_metrics

from graph_trainer.capture.unread import drop_unread

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def _count(graph: fx.Graph, target) -> int:
    return len(graph.find_nodes(op="call_function", target=target))


def test_unread_collective_goes_with_what_it_reads():
    """A reduce-scatter of a matmul whose result only a dead view reads goes, with the matmul; a gather the output
    reads stays, and so does an in-place all-reduce, whose result is its input (read by the output)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.placeholder("y")
    mm = graph.call_function(aten.mm.default, (x, x))
    rs = graph.call_function(c10d.wait_tensor.default, (graph.call_function(c10d.reduce_scatter_tensor.default, (mm, "sum", 2, "0")),))
    graph.call_function(aten.view.default, (rs, [-1]))
    ag = graph.call_function(c10d.wait_tensor.default, (graph.call_function(c10d.all_gather_into_tensor.default, (x, 2, "0")),))
    graph.call_function(c10d.wait_tensor.default, (graph.call_function(c10d.all_reduce_.default, (y, "sum", "0")),))
    graph.output((ag, y))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert drop_unread(gm) == 1
    assert [_count(gm.graph, t) for t in (aten.mm.default, aten.view.default, c10d.reduce_scatter_tensor.default,
                                          c10d.all_gather_into_tensor.default, c10d.all_reduce_.default, c10d.wait_tensor.default)] \
        == [0, 0, 0, 1, 1, 2]


TP2_AC = ("--model.n_layers", "4", "--training.steps", "3", "--metrics.log_freq", "1", "--parallelism.dp_shard", "1",
          "--parallelism.tp", "2", "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2")


@pytest.mark.slow
def test_checkpointed_blocks_do_not_recompute_their_output_at_tp2():
    """4 layers, every 2nd checkpointed, tp 2: the trace holds 29 forward matmuls, 58 backward ones and 6 for each
    checkpointed block's recomputation, not 7 (its last row-parallel matmul and reduce-scatter made the block's
    output, which backward never reads); the losses and grad norms stay eager's, bit for bit."""
    folder = cached_run((*TP2_AC, "--compile.mode", "aot_fx_trace", "--compile.dump_graphs"), 2)
    traced = (folder / "graphs" / "00_traced.py").read_text()
    assert traced.count("torch.ops.aten.mm.default(") == 29 + 58 + 2 * 6
    got = read_metrics(folder)
    assert got[0]["unread_collectives"] == 2
    ref = read_metrics(cached_run((*TP2_AC, "--compile.mode", "eager"), 2))
    assert losses(got) == losses(ref) and grad_norms(got) == grad_norms(ref)
