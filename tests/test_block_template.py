"""The step traced from a few blocks (graph_trainer/capture/block_template.py) is the step traced whole.

Each configuration is traced twice on the fake process group, as `graph-trainer plan` traces it: with the block
template and with every layer through make_fx. The two graphs must be the same ops, names, arguments and values
(`graph_fingerprint`), with the same marks, and their values must alias the same way. The bitwise runs of the
rest of the suite (eager against aot_fx_trace on the 6-layer debug models) train through the template too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import flex_attention

from graph_trainer.blocks import annotate_blocks, node_block
from graph_trainer.capture.optimizer_in_graph import AdamWHyper, ClipAndAdamWStep
from graph_trainer.capture import fake_trace, fx_trace
from graph_trainer.capture.block_template import TemplatePlan, storage_of, tensors_of, plan_templates
from graph_trainer.capture.fake_trace import trace_on_fake_mesh
from graph_trainer.compile_cache import graph_fingerprint
from graph_trainer.config import parse_args
from graph_trainer.losses import cross_entropy
from graph_trainer.passes.block_compile import plan_pieces, runs_as_fx
from graph_trainer.train_step import FunctionalTrainStep, named_buffers

EIGHT = ("--model.n_layers", "8")
CONFIGS = {
    "llama3 dp_shard 2": (2, ("--model.name", "llama3", *EIGHT, "--parallelism.dp_shard", "2")),
    "llama3 dp_shard 2 x tp 2": (4, ("--model.name", "llama3", *EIGHT, "--parallelism.dp_shard", "2", "--parallelism.tp", "2")),
    "llama3 every 2nd block checkpointed": (2, ("--model.name", "llama3", *EIGHT, "--parallelism.dp_shard", "2",
                                                "--activation_checkpoint.mode", "selective",
                                                "--activation_checkpoint.selective_ac_option", "2")),
    "llama3 full AC, dp_replicate 2": (2, ("--model.name", "llama3", *EIGHT, "--parallelism.dp_replicate", "2",
                                           "--activation_checkpoint.mode", "full")),
    "llama3 auto-placed, every 2nd block checkpointed": (2, ("--model.name", "llama3", *EIGHT, "--parallelism.dp_shard", "2",
                                                             "--activation_checkpoint.mode", "selective",
                                                             "--activation_checkpoint.selective_ac_option", "2",
                                                             "--compile.autoparallel")),
    "qwen3 dp_shard 2": (2, ("--model.name", "qwen3", *EIGHT, "--parallelism.dp_shard", "2")),
    "deepseek_v3 dp_shard 2 x ep 2": (4, ("--model.name", "deepseek_v3", *EIGHT, "--parallelism.dp_shard", "2",
                                          "--parallelism.ep", "2")),
    "llama3 FlexAttention": (2, ("--model.name", "llama3", "--model.flavor", "debugmodel_flex_attn", *EIGHT,
                                 "--parallelism.dp_shard", "2")),
    "deepseek_v3 FlexAttention dp_shard 2 x ep 2": (4, ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel_flex_attn",
                                                        *EIGHT, "--parallelism.dp_shard", "2", "--parallelism.ep", "2")),
}
TRACED = {"llama3 every 2nd block checkpointed": 4, "llama3 auto-placed, every 2nd block checkpointed": 6,
          "deepseek_v3 dp_shard 2 x ep 2": 4, "deepseek_v3 FlexAttention dp_shard 2 x ep 2": 4}
"""Blocks make_fx runs (3 unless said): alternating checkpointing needs both kinds inside the template, DeepSeek V3's
first (dense) block differs from its MoE blocks. Auto-placed, the embedding's output reaches the first layer in
another layout (ops the third layer does not have): the template of 4 is refused and the first layer kept apart."""


def _trace(world: int, flags: tuple[str, ...]):
    trace = trace_on_fake_mesh(parse_args(["--compile.mode", "aot_fx_trace", *flags]), world)
    dist.destroy_process_group()
    return trace


def _aliasing(gm) -> list[list[int]]:
    """Per node and value, the index of the first node whose value holds the same storage."""
    first: dict[int, int] = {}
    out = []
    for i, node in enumerate(gm.graph.nodes):
        out.append([first.setdefault(storage_of(t), i) for t in tensors_of(node.meta.get("val"))])
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_step_from_a_few_blocks_is_the_step_traced_whole(name, monkeypatch):
    """With FlexAttention each layer's call registers its own score and mask functions (`sdpa_score<k>`), which the
    copies must number as a whole trace does (DeepSeek V3 16B was traced whole on CUDA for lack of it)."""
    world, flags = CONFIGS[name]
    # FlexAttention has no backward kernel on CPU; a trace on fake tensors runs none
    monkeypatch.setattr(flex_attention, "_validate_device", lambda query, key, value: None)
    templated = _trace(world, flags)
    assert templated.graph.meta["traced_blocks"] == TRACED.get(name, 3)
    monkeypatch.setattr(fx_trace, "plan_templates", lambda model: [])
    whole = _trace(world, flags)
    assert whole.graph.meta["traced_blocks"] == 8
    a, b = templated.graph, whole.graph
    assert graph_fingerprint(a) == graph_fingerprint(b)
    assert [n.meta.get("custom") for n in a.graph.nodes] == [n.meta.get("custom") for n in b.graph.nodes]
    assert {node_block(n) for n in a.graph.nodes} == set(range(8)) | {None}
    assert _aliasing(a) == _aliasing(b)


def _optimizer_step_trace(world: int, flags: tuple[str, ...]):
    """The step of `--compile.optimizer_in_graph` (clipping and AdamW after the backward) of the model as
    `_trace` places it, traced as the trainer traces it."""
    cfg = parse_args(["--compile.mode", "aot_fx_trace", *flags])
    model = trace_on_fake_mesh(cfg, world).model
    try:
        fn = FunctionalTrainStep(model, cross_entropy)
        step = ClipAndAdamWStep(fn, AdamWHyper(0.9, 0.95, 1e-8, 0.1, 1.0), cfg.parallelism.ep > 1)
        params = [p.to_local() for p in model.parameters() if p.requires_grad]
        _, buffers = named_buffers(model)
        tokens = torch.empty(1, cfg.training.seq_len, dtype=torch.long, device="meta")
        scalar = torch.empty((), dtype=torch.float64, device="meta")
        return fx_trace.trace_train_step(step, params, buffers, tokens, tokens, torch.device("cpu"), [*params, *params, scalar, scalar])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["llama3 dp_shard 2", "deepseek_v3 dp_shard 2 x ep 2"])
def test_the_in_graph_optimizer_step_from_a_few_blocks_is_the_step_traced_whole(name, monkeypatch):
    """Its update (capture/update_tail.py) is traced apart and appended to the expanded step."""
    world, flags = CONFIGS[name]
    templated = _optimizer_step_trace(world, flags)
    assert templated.meta["traced_blocks"] == TRACED.get(name, 3)
    monkeypatch.setattr(fx_trace, "plan_templates", lambda model: [])
    whole = _optimizer_step_trace(world, flags)
    assert whole.meta["traced_blocks"] == 8
    assert any(n.target is torch.ops.aten.copy_.default for n in templated.graph.nodes)
    assert graph_fingerprint(templated) == graph_fingerprint(whole)
    assert [n.meta.get("custom") for n in templated.graph.nodes] == [n.meta.get("custom") for n in whole.graph.nodes]
    assert _aliasing(templated) == _aliasing(whole)


def test_the_in_graph_optimizers_gradient_norm_runs_as_fx_and_its_update_is_compiled():
    """`_foreach_norm` over every gradient is one multi-tensor kernel in ATen and a reduction per gradient in Inductor
    (the slowest of llama3 8B's pieces to compile): its piece runs as FX; the clipping and AdamW are compiled."""
    world, flags = CONFIGS["llama3 dp_shard 2"]
    plan = plan_pieces(_optimizer_step_trace(world, flags))

    def holds(members, op):
        return any(n.target is op for n in members[0].module.graph.nodes)

    norm = [members for members in plan.groups if holds(members, torch.ops.aten._foreach_norm.Scalar)]
    assert len(norm) == 1 and runs_as_fx(norm[0])
    assert not any(holds(members, torch.ops.aten._foreach_norm.Scalar) for members in plan.compiled_groups)
    assert any(holds(members, torch.ops.aten.lerp.Scalar) for members in plan.compiled_groups)


def test_a_buffer_nothing_reads_between_blocks_stays_with_its_block(monkeypatch):
    """On CUDA a checkpointed block's forward ended with an unmarked buffer that nothing reads (llama3 8B, one H200):
    it reads no layer either, and taken for shared it split the run of forward blocks, so the template was refused.
    Here a hook after each block makes one (after an op of its own, an unused product, so that no forward op's
    `seq_nr` gives it the block's marks)."""
    world, flags = CONFIGS["llama3 dp_shard 2"]

    def dead_buffer(module, args, out):
        out * 1
        torch.empty(4, device=out.device)

    def with_dead_buffers(model):
        model = annotate_blocks(model)
        for block in model.layers.values():
            block.register_forward_hook(dead_buffer)
        return model

    monkeypatch.setattr(fake_trace, "annotate_blocks", with_dead_buffers)
    # the trace drops what nothing reads at its end (capture/unread.py): kept here, to see where the buffers went
    monkeypatch.setattr(fx_trace, "drop_unread", lambda gm: 0)
    templated = _trace(world, flags)
    assert templated.graph.meta["traced_blocks"] == 3
    dead = [n for n in templated.graph.graph.nodes if n.target is torch.ops.aten.empty.memory_format and not n.users]
    assert len(dead) == 8 and all(node_block(n) is None for n in dead)
    monkeypatch.setattr(fx_trace, "plan_templates", lambda model: [])
    assert graph_fingerprint(templated.graph) == graph_fingerprint(_trace(world, flags).graph)


def test_the_plan_traces_the_fewest_blocks_that_cover_every_layer():
    trace = _trace(2, ("--model.name", "deepseek_v3", "--model.n_layers", "8", "--parallelism.dp_shard", "2"))
    # a dense block, then MoE ones: layer 1 repeats traced layer 1 (dense before, MoE after), the MoE interior
    # layers traced layer 2, the last the last traced
    assert plan_templates(trace.model)[0] == TemplatePlan(tuple(map(str, range(8))), 4, (0, 1, 2, 2, 2, 2, 2, 3))
    short = _trace(2, ("--model.name", "llama3", "--model.n_layers", "4", "--parallelism.dp_shard", "2"))
    assert plan_templates(short.model) == [] and short.graph.meta["traced_blocks"] == 4
