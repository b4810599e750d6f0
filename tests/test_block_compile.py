"""Block reuse in the full Inductor compile (graph_trainer/blocks.py, passes/block_compile.py): the
blocks' marks reach the backward, the step is cut where each block phase starts, pieces of the same
structure are compiled once however deep the model, and the pieces compute bit for bit what the
whole-graph compile computes, also where collectives cross pieces on two gloo ranks and where a
compiled piece is called again while the outputs of its earlier calls are still read."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx import traceback as fx_traceback

from helpers import cached_run, grad_norms, losses, read_metrics
from test_bucketing import fake_pg, trace_llama  # noqa: F401  (fake_pg is a fixture)
from test_inductor_passes import DIM, SMALL, Block, toy_train_step
from traced_step import trace_step

from graph_trainer.blocks import annotate_blocks, block_starts, node_block
from graph_trainer.graph_dump import is_collective
from graph_trainer.passes import block_compile, inductor
from graph_trainer.passes.block_compile import plan_pieces
from graph_trainer.passes.async_tp import tp_group
from graph_trainer.passes.bucketing_compat import ALL_GATHER, REDUCE_SCATTER, WAIT
from graph_trainer.passes.registry import Compiled, PassContext, apply_passes


class Deep(nn.Module):
    def __init__(self, n_layers: int):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def deep_step(n_layers: int):
    torch.manual_seed(0)
    return toy_train_step(annotate_blocks(Deep(n_layers)))


def counting_fx_compile(monkeypatch) -> list[fx.GraphModule]:
    """`_compile_whole` replaced by running the graph as FX (no Inductor), recording each graph it gets."""
    compiled: list[fx.GraphModule] = []

    def compile_whole(gm, ctx):
        compiled.append(gm)
        return Compiled(gm, gm)

    monkeypatch.setattr(inductor, "_compile_whole", compile_whole)
    return compiled


def test_blocks_are_marked_in_forward_and_backward_and_start_in_graph_order():
    gm, _, _ = deep_step(3)
    starts = [(s.phase, s.block) for s in block_starts(gm)]
    assert starts == [("forward", 0), ("forward", 1), ("forward", 2), ("backward", 2), ("backward", 1), ("backward", 0)]
    # every matmul ran inside a block: 3 per block forward, 2 per forward matmul in backward but the
    # first block's input gradient (the batch needs none)
    mms = [n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default]
    assert len(mms) == 9 + 17 and all(node_block(n) is not None for n in mms)
    assert [sum(node_block(n) == b for n in mms) for b in range(3)] == [8, 9, 9]


def test_ops_nothing_reads_are_in_no_piece():
    """On CUDA, DTensor's norm of the gradients leaves a `_foreach_norm` of empty tensors that nothing reads in the
    in-graph optimizer's step (`block_compile.unread_ops`); in a piece of its own it compiled to nothing, which the
    compile cache could not store. Such ops are left out of every piece: the pieces are those of the step without
    them, and they still compute its results."""
    gm, ctx, real = deep_step(4)
    with torch.no_grad():
        expected = gm(*real)
    before = [p.source.structure() for p in plan_pieces(gm).pieces]
    with gm.graph.inserting_before(block_starts(gm)[2].node):
        empty = gm.graph.call_function(torch.ops.aten.empty_strided.default, ([4, 4], [4, 1]), {"dtype": torch.float32})
        norms = gm.graph.call_function(torch.ops.aten._foreach_norm.Scalar, ([empty, empty], 2))
        first = gm.graph.call_function(operator.getitem, (norms, 0))
    gm.recompile()
    assert {empty, norms, first} <= block_compile.unread_ops(gm)
    plan = plan_pieces(gm)
    assert [p.source.structure() for p in plan.pieces] == before
    runner = plan.compile(ctx, lambda piece, ctx: Compiled(piece, piece))
    assert all(torch.equal(a, b) for a, b in zip(expected, runner(*real)))


def test_a_deeper_model_compiles_the_same_pieces(monkeypatch):
    compiled = counting_fx_compile(monkeypatch)
    counts = {}
    for n_layers in (4, 8):
        gm, ctx, real = deep_step(n_layers)
        with torch.no_grad():
            expected = gm(*real)
        plan = plan_pieces(gm)
        runner = plan.compile(ctx, inductor._compile_whole)
        counts[n_layers] = (len(compiled), len(plan.pieces))
        compiled.clear()
        assert all(torch.equal(a, b) for a, b in zip(expected, runner(*real)))
    # first, middle and last block in forward and backward (the first block's input needs no
    # gradient, so its backward differs), with the loss in the last forward block
    assert counts == {4: (5, 8), 8: (5, 16)}


def test_block_reuse_is_used_where_the_distinct_pieces_hold_at_most_half_the_ops(monkeypatch):
    """5 distinct pieces: of 8 pieces at 4 blocks they hold more than half the ops (compiled whole), of 16 at 8 less."""
    compiled = counting_fx_compile(monkeypatch)
    for n_layers, reused in ((4, False), (8, True)):
        gm, ctx, _ = deep_step(n_layers)
        inductor.full_inductor_compilation(gm, ctx)
        figures = {"compiled_blocks": 5, "block_pieces": 16} if reused else {"compiled_blocks": 1, "block_pieces": 1}
        assert ctx.report["full_inductor_compilation"] == {**figures, "layers": n_layers}
        assert len(compiled) == figures["compiled_blocks"]
        compiled.clear()


def test_llama3_with_per_block_buckets_compiles_the_same_pieces_at_6_and_8_layers(fake_pg, monkeypatch):
    """dp_shard 2 with one all-gather and one reduce-scatter bucket per block: a prefetched all-gather
    leaves the piece that issues it un-waited and is waited in the next. The cost model prefetches 3
    blocks ahead on CPU, so the communication of the last 3 blocks of each phase differs; in pieces of
    its own, it leaves one forward and one backward piece of compute for every block, and from 6 layers
    on the count stays."""
    compiled = counting_fx_compile(monkeypatch)
    counts = {}
    for n_layers in (6, 8):
        gm, ctx = trace_llama("--model.n_layers", str(n_layers))
        gm = apply_passes(gm, ["transformer_block_bucketing"], ctx, "train_step")
        plan = plan_pieces(gm)
        plan.compile(ctx, inductor._compile_whole)
        counts[n_layers] = (len(compiled), len(plan.pieces))
        crossing = [p for p in plan.pieces
                    if any(a.op == "placeholder" and any(u.target is WAIT for u in a.users) for a in p.module.graph.nodes)
                    and any(n.target is ALL_GATHER for n in p.module.graph.output_node().all_input_nodes)]
        assert crossing, "no piece both waits for a collective issued before it and issues one waited after it"
        compiled.clear()
    # 16 distinct pieces; 9 run as FX: one only takes views, 8 are communication at the ends of a phase, run once or
    # twice a step (block_compile.FX_RUNS)
    assert counts == {6: (7, 33), 8: (7, 41)}
    compute = [members for members in plan.groups if not any(is_collective(n) for n in members[0].module.graph.nodes)
               and any(node_block(n) is not None for n in members[0].module.graph.nodes)]
    assert [len(members) for members in compute] == [8, 8], "a block's forward or backward compute differs from the others'"


def test_tensor_parallel_collectives_stay_with_the_compute_around_them(fake_pg):
    """llama3 debug, 4 layers, tp 2: the TP gathers before column-parallel matmuls and reduce-scatters after row-parallel
    ones are the same in every block, so they stay in the pieces of block compute (cut out as communication, each of
    them made two more pieces a step): no piece that holds one is a piece of communication."""
    gm, ctx = trace_step("llama3", 1, 2, 1, "--model.n_layers", "4")
    group = tp_group(ctx)
    plan = plan_pieces(gm)
    with_tp = [p for p in plan.pieces if any(n.target in (ALL_GATHER, REDUCE_SCATTER) and n.args[-1] == group
                                             for n in p.module.graph.nodes)]
    assert with_tp
    assert not any(p.communication for p in with_tp)
    assert sum(any(n.target is torch.ops.aten.mm.default for n in p.module.graph.nodes) for p in with_tp) >= 4 * 2


def _ops(gm: fx.GraphModule) -> list:
    return [(n.op, str(n.target), (n.meta.get("custom") or {}), n.meta.get("stack_trace")) for n in gm.graph.nodes]


def test_decomposing_each_distinct_piece_once_gives_the_whole_decomposition(monkeypatch):
    """The 8-block step (5 distinct pieces of 16) decomposed piece by piece: the same ops in the same order, each with
    its own block's marks and source, computing the same values bit for bit."""
    gm, ctx, real = deep_step(8)
    whole = inductor.decompose(gm, inductor.fake_inputs(gm, ctx))
    calls = []
    decompose = inductor.decompose
    monkeypatch.setattr(inductor, "decompose", lambda piece, inputs: calls.append(piece) or decompose(piece, inputs))
    pieces = inductor.inductor_decomposition(gm, ctx)
    assert len(calls) == 5
    assert _ops(pieces) == _ops(whole)
    assert [s.block for s in block_starts(pieces)] == [s.block for s in block_starts(whole)] == [*range(8), *reversed(range(8))]
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(whole(*real), pieces(*real)))


def test_llama3_decomposed_by_piece_equals_the_whole_decomposition_where_collectives_cross_pieces(fake_pg, monkeypatch):
    """12 blocks, 16 distinct pieces (see above): prefetched all-gathers issued in one piece and waited in the next.
    Every group is decomposed here, also those that otherwise run as FX (block_compile.runs_as_fx)."""
    monkeypatch.setattr(block_compile, "runs_as_fx", lambda members: False)
    gm, ctx = trace_llama("--model.n_layers", "12")
    gm = apply_passes(gm, ["transformer_block_bucketing"], ctx, "train_step")
    whole = inductor.decompose(gm, inductor.fake_inputs(gm, ctx))
    calls = []
    decompose = inductor.decompose
    monkeypatch.setattr(inductor, "decompose", lambda piece, inputs: calls.append(piece) or decompose(piece, inputs))
    assert _ops(inductor.inductor_decomposition(gm, ctx)) == _ops(whole)
    assert len(calls) == 16


def _aot_graphs(n_layers: int) -> dict[str, tuple[fx.GraphModule, list[torch.Tensor]]]:
    """Deep(n_layers)'s forward and backward graphs as AOTAutograd's min-cut partitioner leaves them (aot mode's, a
    pipeline stage's), each with the inputs it was called with."""
    torch.manual_seed(0)
    model = annotate_blocks(Deep(n_layers))
    graphs: dict[str, tuple[fx.GraphModule, list[torch.Tensor]]] = {}

    def compiler(stage: str):
        def compile(gm: fx.GraphModule, example_inputs):
            def run(args):
                graphs[stage] = (gm, list(args))
                return gm(*args)
            run._boxed_call = True
            return run
        return compile

    names = [n for n, _ in model.named_parameters()]
    step = aot_function(lambda *args: torch.func.functional_call(model, dict(zip(names, args[:-1])), (args[-1],)),
                        fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                        partition_fn=min_cut_rematerialization_partition)
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    with fx_traceback.preserve_node_meta():
        step(*params, torch.randn(4, DIM)).sum().backward()
    return graphs


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_forward_and_backward_graphs_reuse_their_blocks_and_compute_bit_for_bit_the_same(stage, monkeypatch):
    """A graph of one phase has no loss to tell forward from backward: each block starts once, and its pieces
    repeat as in the train step's (8 blocks: 4 distinct pieces of 9)."""
    gm, real = _aot_graphs(8)[stage]
    ctx = PassContext(cfg=None, meshes=None, device=torch.device("cpu"), stage=stage)
    whole = inductor.decompose(gm, inductor.fake_inputs(gm, ctx))
    compiled = counting_fx_compile(monkeypatch)
    runner = inductor.full_inductor_compilation(inductor.inductor_decomposition(gm, ctx), ctx)
    report = ctx.report["full_inductor_compilation"]
    assert len(compiled) == report["compiled_blocks"] < report["block_pieces"]
    assert report["layers"] == (8 if stage == "forward" else 0)
    with torch.no_grad():
        expected, got = whole(*real), runner(*real)
    # the backward's gradient of the batch, which needs none, is None in both
    assert len(expected) == len(got) and all(a is b is None or torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.slow
def test_block_reuse_trains_bit_for_bit_like_the_whole_compile_on_two_gloo_ranks():
    """llama3 debugmodel (6 blocks) on two gloo ranks with the default overlap schedule: prefetched all-gathers issued
    in one piece and waited in a later one, reduce-scatters waited a block later, each compiled piece called for
    every block while the outputs of its earlier calls are still read. The same run as test_inductor_passes'."""
    flags = (*SMALL, "--parallelism.dp_shard", "2", "--compile.mode", "aot_fx_trace", "--compile.inductor_compilation",
             "full", "--compile.dump_graphs")
    pieces = read_metrics(cached_run(flags, 2))
    whole = read_metrics(cached_run((*flags, "--compile.block_reuse", "false"), 2))
    assert losses(pieces) == losses(whole) and grad_norms(pieces) == grad_norms(whole)
    first = pieces[0]
    assert first["layers"] == 6 and first["compiled_blocks"] < first["block_pieces"], first
    assert (whole[0]["compiled_blocks"], whole[0]["block_pieces"]) == (1, 1)


@pytest.mark.slow
def test_the_optimizer_traced_in_is_compiled_once_per_parameter_shape_and_trains_bit_for_bit():
    """With `--compile.optimizer_in_graph` each parameter's update is a piece: the updates of parameters of one shape
    are compiled once (the optimizer added about 3x to the compile of llama3 8B, one update per parameter)."""
    from graph_trainer import models

    flags = ("--training.steps", "3", "--training.batch_size", "2", "--training.seq_len", "64", "--model.n_layers", "4",
             "--metrics.log_freq", "1", "--compile.mode", "aot_fx_trace", "--compile.inductor_compilation", "full",
             "--compile.optimizer_in_graph")
    pieces = read_metrics(cached_run(flags))
    whole = read_metrics(cached_run((*flags, "--compile.block_reuse", "false")))
    assert losses(pieces) == losses(whole) and grad_norms(pieces) == grad_norms(whole)
    spec = models.get_spec("llama3")
    shapes = [tuple(p.shape) for p in models.build_on_meta(spec, spec.args_for("debugmodel", 64, 4), "cpu").parameters()]
    first = pieces[0]
    assert first["block_pieces"] - first["compiled_blocks"] >= len(shapes) - len(set(shapes)), (first, sorted(set(shapes)))
