"""llama3 `debugmodel_flex_attn`: the model builds its document (block-causal) BlockMask from the tokens
of each call, so eager runs and a traced graph mask each batch by its own document boundaries.

FlexAttention has no backward on CPU: these tests run forward only; training this flavor (eager,
aot_fx_trace, regional_inductor) is measured on the GPU by bench/run.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer import models

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
