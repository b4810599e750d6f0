"""llama3 `debugmodel_flex_attn`: the model builds its document (block-causal) BlockMask from the tokens
of each call, so eager runs and a traced graph mask each batch by its own document boundaries.

FlexAttention has no backward on CPU: these tests run forward only, or trace the step on fake tensors (its
score and mask functions as subgraphs of the step's pieces, passes/block_compile.py); training this flavor (eager,
aot_fx_trace, regional_inductor) is measured on the GPU by bench/run.py.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import flex_attention

from test_block_compile import counting_fx_compile

from graph_trainer import graph_pickle, models
from graph_trainer.capture.fake_trace import trace_on_fake_mesh
from graph_trainer.config import parse_args
from graph_trainer.passes import block_compile, compile_workers, inductor
from graph_trainer.passes.block_compile import plan_pieces
from graph_trainer.passes.registry import PassContext

EOS = 1
SEQ = 128


def _model(flavor: str) -> torch.nn.Module:
    spec = models.get_spec("llama3")
    torch.manual_seed(0)
    model = spec.model_cls(spec.args_for(flavor, SEQ))
    with torch.no_grad():
        model.init_weights()
    models.install_attention_masks(model, EOS)
    return model.eval()


@pytest.fixture(scope="module")
def flex_and_sdpa():
    flex, sdpa = _model("debugmodel_flex_attn"), _model("debugmodel")
    sdpa.load_state_dict(flex.state_dict())
    return flex, sdpa


def _tokens(seed: int, eos_at: int | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(EOS + 1, 2048, (2, SEQ), generator=g)
    if eos_at is not None:
        tokens[:, eos_at] = EOS
    return tokens


@torch.no_grad()
def test_without_document_ends_flex_equals_causal_sdpa(flex_and_sdpa):
    flex, sdpa = flex_and_sdpa
    tokens = _tokens(0, eos_at=None)
    torch.testing.assert_close(flex(tokens), sdpa(tokens), rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_documents_do_not_attend_to_each_other(flex_and_sdpa):
    flex, sdpa = flex_and_sdpa
    eos_at = 40
    a = _tokens(1, eos_at)
    b = a.clone()
    b[:, :eos_at] = _tokens(2, None)[:, :eos_at]  # another first document, same second one
    after = slice(eos_at + 1, None)
    torch.testing.assert_close(flex(a)[:, after], flex(b)[:, after], rtol=0, atol=1e-5)
    assert not torch.allclose(sdpa(a)[:, after], sdpa(b)[:, after], atol=1e-3)


@torch.no_grad()
def test_traced_graph_masks_each_batch_by_its_own_documents(flex_and_sdpa):
    flex, _ = flex_and_sdpa
    with models.traceable_attention():
        graph = make_fx(lambda t: flex(t), tracing_mode="real")(_tokens(3, eos_at=100))
    for seed, eos_at in ((4, 20), (5, 70)):
        tokens = _tokens(seed, eos_at)
        torch.testing.assert_close(graph(tokens), flex(tokens), rtol=0, atol=1e-5)


@torch.no_grad()
def test_regions_leave_flex_attention_score_and_mask_functions_to_the_op(flex_and_sdpa):
    """Inductor compiles FlexAttention's score and mask subgraphs with the op; a region mark left
    inside them makes torch 2.11's regional_inductor compile them apart, and the op then fails."""
    from torch.fx import traceback as fx_traceback

    from graph_trainer.passes.inductor import unmark_subgraphs
    from graph_trainer.regions import REGION_KEY, annotate_regions

    flex = annotate_regions(_model("debugmodel_flex_attn"))
    state = {**dict(flex.named_parameters()), **dict(flex.named_buffers())}
    with models.traceable_attention(), fx_traceback.preserve_node_meta():
        gm = make_fx(lambda s, t: torch.func.functional_call(flex, s, (t,)), tracing_mode="fake")(state, _tokens(3, 100))

    def marked(graph):
        return [n for n in graph.nodes if REGION_KEY in (n.meta.get("custom") or {})]

    subgraphs = [getattr(gm, n.target) for n in gm.graph.find_nodes(op="get_attr")]
    subgraphs = [s for s in subgraphs if isinstance(s, torch.fx.GraphModule)]
    flex_ops = [n for n in gm.graph.nodes if "flex_attention" in str(n.target)]
    assert len(flex_ops) == 6 and len(subgraphs) == 12
    assert all(marked(s.graph) for s in subgraphs)
    unmark_subgraphs(gm)
    assert not any(marked(s.graph) for s in subgraphs)
    assert set(flex_ops) <= set(marked(gm.graph))


def test_document_mask_equals_torchtitans_without_a_shifted_copy():
    """Same mask as torchtitan's `get_document_mask_mod`; its document index is built without the
    shifted in-place copy that Inductor's FlexAttention template cannot load inside the mask function."""
    from torchtitan.models.attention import get_document_mask_mod

    tokens = _tokens(6, eos_at=30)
    tokens[0, -1] = EOS
    tokens[1, 0] = EOS
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(SEQ), torch.arange(SEQ), indexing="ij")
    ours = models.document_mask_mod(tokens, EOS)(b, None, q, kv)
    assert torch.equal(ours, get_document_mask_mod(tokens, EOS)(b, None, q, kv))
    graph = make_fx(lambda t: models.document_mask_mod(t, EOS)(b, None, q, kv))(tokens)
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert not any("slice_scatter" in t or "copy_" in t for t in targets), targets


def test_backward_of_a_higher_order_op_joins_its_forward_region():
    """FlexAttention's backward op carries its autograd Function's seq_nr, which no forward op has:
    it must still land in the attention region (else it runs unfused, materialising the scores),
    with the subgraphs it calls and the gradients it returns."""
    import operator

    from graph_trainer.regions import REGION_KEY, copy_marks_to_backward

    mark = {REGION_KEY: {"region": "attention"}}
    g = torch.fx.Graph()
    q = g.placeholder("q")
    fwd = g.call_function(torch.ops.aten.mul.Tensor, (q, q))
    fwd.meta.update(custom=dict(mark), seq_nr=10)
    loss = g.call_function(torch.ops.aten.sum.default, (fwd,))
    loss.meta.update(seq_nr=11)
    sub = g.get_attr("joint_graph")
    hop = g.call_function(torch.ops.higher_order.flex_attention_backward, (q, fwd, sub))
    hop.meta.update(seq_nr=8)
    grad = g.call_function(operator.getitem, (hop, 0))
    other = g.call_function(torch.ops.aten.neg.default, (grad,))
    other.meta.update(seq_nr=3)
    g.output((loss, other))
    root = torch.nn.Module()
    root.joint_graph = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    gm = torch.fx.GraphModule(root, g)
    copy_marks_to_backward(gm)
    marked = {n.name for n in gm.graph.nodes if REGION_KEY in (n.meta.get("custom") or {})}
    assert marked == {fwd.name, hop.name, sub.name, grad.name}


def test_deepseek_large_flavors_use_flex_document_masks_unless_sdpa_is_asked():
    spec = models.get_spec("deepseek_v3")
    for flavor in ("16B", "671B"):
        args = spec.args_for(flavor, 4096)
        assert (args.attn_type, args.attn_mask_type) == ("flex", "block_causal")
        args = spec.args_for(flavor, 4096, attention="sdpa")
        assert (args.attn_type, args.attn_mask_type) == ("sdpa", "causal")
    flex_1b = models.get_spec("llama3").args_for("1B_flex_attn", 4096)
    assert (flex_1b.attn_type, flex_1b.attn_mask_type, flex_1b.dim) == ("flex", "block_causal", 2048)


@torch.no_grad()
def test_full_inductor_gets_the_mask_as_inputs_built_by_a_prologue(flex_and_sdpa):
    """Full Inductor compiles FlexAttention only when its block mask arrives as graph inputs: the mask
    is built from the token ids by a prologue graph, and the main graph equals the traced one."""
    from graph_trainer.passes.inductor import split_mask_prologue

    flex, _ = flex_and_sdpa
    state = {**dict(flex.named_parameters()), **dict(flex.named_buffers())}

    def forward(*flat):
        return torch.func.functional_call(flex, dict(zip(state, flat[:-1])), (flat[-1],))

    with models.traceable_attention():
        gm = make_fx(forward, tracing_mode="fake")(*state.values(), _tokens(3, 100))
    prologue, main = split_mask_prologue(gm)
    ops = lambda g: {str(n.target) for n in g.graph.nodes if n.op == "call_function"}  # noqa: E731
    assert "aten.cumsum.default" in ops(prologue) and "aten.cumsum.default" not in ops(main)
    assert any("flex_attention" in t for t in ops(main)) and not any("flex_attention" in t for t in ops(prologue))
    hops = [n for n in main.graph.nodes if "flex_attention" in str(n.target)]
    token_inputs = {n for n in main.graph.find_nodes(op="placeholder") if n.name.endswith("_mask")}
    assert token_inputs and all(token_inputs & set(n.all_input_nodes) for n in hops)
    args = [*state.values(), _tokens(4, 20)]
    torch.testing.assert_close(main(*args, *prologue(*args)), gm(*args), rtol=0, atol=0)


FLEX = {
    "llama3 dp_shard 2": (2, ("--model.name", "llama3", "--parallelism.dp_shard", "2")),
    "deepseek_v3 dp_shard 2 x ep 2": (4, ("--model.name", "deepseek_v3", "--parallelism.dp_shard", "2", "--parallelism.ep", "2")),
}


def _flex_step(world: int, flags: tuple[str, ...], monkeypatch) -> tuple[fx.GraphModule, PassContext]:
    """A 4-layer FlexAttention model's train step traced on the fake process group, as `graph-trainer plan` traces it."""
    # FlexAttention has no backward kernel on CPU; a trace on fake tensors runs none
    monkeypatch.setattr(flex_attention, "_validate_device", lambda query, key, value: None)
    cfg = parse_args(["--compile.mode", "aot_fx_trace", "--compile.inductor_compilation", "full", "--compile.cache_dir", "",
                      "--model.flavor", "debugmodel_flex_attn", "--model.n_layers", "4", *flags])
    trace = trace_on_fake_mesh(cfg, world)
    dist.destroy_process_group()
    return trace.graph, PassContext(cfg=cfg, meshes=trace.meshes, device=torch.device("cpu"))


def _ops_and_marks(gm: fx.GraphModule) -> list[tuple]:
    """Each node's op, target and mark, but the ops nothing reads (no piece holds them); a subgraph by its code (a
    piece's copy is named `_piece<k>_sdpa_score0`)."""
    unread = block_compile.unread_ops(gm)
    return [(n.op, getattr(gm, n.target).code if n.op == "get_attr" else str(n.target), n.meta.get("custom"))
            for n in gm.graph.nodes if n not in unread]


@pytest.mark.parametrize("name", list(FLEX))
def test_a_flex_attention_step_is_decomposed_by_pieces_into_the_whole_decomposition(name, monkeypatch):
    """FlexAttention's score and mask functions are subgraphs the pieces read (forward's `sdpa_score<k>`,
    backward's `fw_graph<k>`, ...): each distinct piece is decomposed with its own copy of them, and the stitched
    step is the whole decomposition op for op (but the few ops nothing reads, which `create_block_mask` leaves),
    each op with its own block's mark. The ops that build the masks
    from the token ids are pieces of their own, run as FX (compiled, DeepSeek V3 16B's took 71 s on a GPU), so
    no compiled piece builds a mask it reads (Inductor on torch 2.11 cannot compile that: `split_mask_prologue`)."""
    gm, ctx = _flex_step(*FLEX[name], monkeypatch)
    masks = block_compile.flex_attention_masks(gm)
    plan = plan_pieces(gm)
    mask_groups = [members for members in plan.groups if members[0].builds_masks]
    built = {n for members in mask_groups for p in members for n in p.source.ops}
    assert {n for n in built if n.target is not operator.getitem} == {n for n in masks if n.target is not operator.getitem}
    assert len(masks) > 10
    assert all(block_compile.runs_as_fx(members) for members in mask_groups)
    assert all(not masks & set(members[0].source.ops) for members in plan.compiled_groups)
    # every group decomposed, as the compiled ones are: a group that runs as FX stays as traced
    monkeypatch.setattr(block_compile, "runs_as_fx", lambda members: False)
    whole = inductor.decompose(gm, inductor.fake_inputs(gm, ctx))
    by_pieces = inductor.inductor_decomposition(gm, ctx)
    plan = by_pieces.meta[block_compile.PIECES]
    assert ctx.report["inductor_decomposition"]["decomposed_pieces"] == len(plan.groups) < len(plan.pieces)
    assert _ops_and_marks(by_pieces) == _ops_and_marks(whole)
    assert len([n for n in by_pieces.graph.nodes if n.op == "get_attr"]) == 4 * (2 + 3)
    compiled = counting_fx_compile(monkeypatch)
    inductor.full_inductor_compilation(by_pieces, ctx)
    assert [id(g) for g in compiled] == [id(members[0].module) for members in plan.groups]


def test_a_piece_goes_to_a_compile_worker_with_the_subgraphs_it_reads(monkeypatch):
    """What a worker decomposes (compile_worker_process.py) is what the rank would: the piece as sent and loaded,
    its FlexAttention subgraphs with it."""
    gm, ctx = _flex_step(*FLEX["llama3 dp_shard 2"], monkeypatch)
    plan = plan_pieces(gm)
    reading = [members[0].module for members in plan.groups if members[0].module.graph.find_nodes(op="get_attr")]
    assert len(reading) == 2
    for piece in reading:
        loaded = graph_pickle.loads(graph_pickle.dumps(compile_workers._sendable(piece)))
        inputs = [n.meta["val"] for n in loaded.graph.find_nodes(op="placeholder")]
        sent = inductor.decompose(loaded, inputs)
        here = inductor.decompose(piece, inductor.fake_inputs(piece, ctx))
        assert _ops_and_marks(sent) == _ops_and_marks(here)
        assert sum(n.target is torch.ops.higher_order.flex_attention_backward for n in sent.graph.nodes) == (piece is reading[1])
