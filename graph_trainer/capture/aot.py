"""aot mode: the joint forward+backward graph exported ahead of time, partitioned, compiled.

`aot_export_joint_with_descriptors` traces `LossModule` (model + loss + loss scale) on fake copies of
its parameters, buffers and batch into one joint graph. The parameters are the model's sharded
DTensor storage and AOTAutograd flattens each into its local shard, so the SimpleFSDP gathers run
inside the trace and the graph holds the all-gathers of forward and the reduce-scatters of
backward as ops. Stages, each dumped with `GraphDumper`: `joint`, the joint passes, then
`min_cut_rematerialization_partition` (through `compat.min_cut_partition`) splits it, and
`forward` / `backward` (and their passes) go through `aot_compile_joint_with_descriptors`. The
result is an autograd function: calling it runs the forward graph, `loss.backward()` runs the
backward graph and autograd adds the DTensor gradients into `param.grad`.

Shapes are baked in: a batch of a new shape exports again (`stats["retraces"]`); the graphs of every
shape seen are kept.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch.fx import traceback as fx_traceback

from graph_trainer.backends import get_backend

from ..graph_dump import GraphDumper
from ..parallel.compat import is_lead_process
from ..models import traceable_attention
from ..passes.memory_policy import activation_passes
from ..passes.reshard import parameter_passes
from ..passes.registry import PassContext, Stage, apply_passes
from ..train_step import LossFn
from .registry import CaptureContext, register_capture
from .compat import (
    BufferAOTInput,
    ParamAOTInput,
    aot_compile_joint_with_descriptors,
    aot_export_joint_with_descriptors,
    make_boxed_func,
    min_cut_partition,
)


class LossModule(nn.Module):
    """Model + loss as one module: the unit jit compiles and aot exports. Its parameters and buffers
    are the model's (under the prefix `model.`)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, loss_scale: float):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(self.model(inputs), labels)
        if self.loss_scale != 1.0:
            loss = loss * self.loss_scale
        return loss


def pass_context(ctx: CaptureContext, gm: fx.GraphModule, example_inputs: Sequence[Any], dumper: GraphDumper) -> PassContext:
    """The PassContext of an AOTAutograd graph. Its leading inputs that come from parameters are
    found from AOTAutograd's input descriptors: a DTensor parameter may flatten into more than one
    input (torch 2.13 adds its device mesh), so `param_fqns` names the parameter of each of them."""
    param_fqns: list[str] = []
    num_buffers = 0
    for node in gm.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        while hasattr(desc, "base"):
            desc = desc.base
        if isinstance(desc, ParamAOTInput) and not num_buffers:
            # Drop LossModule's `model.` so the names are the model's own FQNs.
            param_fqns.append(desc.target.partition(".")[2])
        elif isinstance(desc, BufferAOTInput):
            num_buffers += 1
        else:
            break
    return PassContext(
        cfg=ctx.cfg,
        meshes=ctx.meshes,
        device=ctx.device,
        example_inputs=list(example_inputs),
        dumper=dumper,
        num_params=len(param_fqns),
        num_buffers=num_buffers,
        param_fqns=param_fqns,
        # One report across the joint, forward and backward passes of a capture.
        report=ctx.stats.setdefault("pass_reports", {}),
    )


def report_passes(stats: dict) -> None:
    """Copy the passes' figures of every capture so far (the compile cache's outcome and counts among them)
    into the stats the step-1 record shows."""
    for figures in stats["pass_reports"].values():
        stats.update(figures)


def _drop_recompute_tags(gm: fx.GraphModule) -> None:
    """The partitioner has acted on the activation-checkpoint tags (resharding, selective AC). Left on
    a stage graph, Inductor would rematerialise from them a second time, and refuses when a scheduling
    pass has reordered the tagged ops ("Detected 7 disjoint backward regions that require recomputation")."""
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)
        node.meta.pop("ac_graph_id", None)


class StageCompiler:
    """An AOTAutograd forward or backward compiler: dump the partitioned graph, run the passes that
    declare its stage, return the result in AOTAutograd's boxed calling convention. Counts its
    calls and the seconds spent compiling (`seconds`) and running what it compiled (`run_seconds`)."""

    def __init__(self, ctx: CaptureContext, stage: Stage, pass_names: list[str], dumper: Callable[[], GraphDumper]):
        self.ctx = ctx
        self.stage = stage
        self.pass_names = pass_names
        self.dumper = dumper
        self.calls = 0
        self.seconds = 0.0
        self.run_seconds = 0.0

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
        t0 = time.perf_counter()
        dumper = self.dumper()
        _drop_recompute_tags(gm)
        dumper.dump(self.stage, gm)
        if any(n.op == "call_function" for n in gm.graph.nodes):
            compiled = apply_passes(gm, self.pass_names, pass_context(self.ctx, gm, example_inputs, dumper), self.stage)
        else:
            # nothing to compute (the input-gradient part of a first pipeline stage, whose input is token ids):
            # Inductor would make no artifact of it, which the compile cache cannot store
            compiled = gm

        def run(*args: Any) -> Any:
            start = time.perf_counter()
            out = compiled(*args)
            self.run_seconds += time.perf_counter() - start
            return out

        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return make_boxed_func(run)


def dump_folder(ctx: CaptureContext, retrace: int) -> str | None:
    """Where a capture's graphs go: `graphs/` for the first, `graphs/retrace_N/` for the Nth
    recapture; None when dumps are off and on ranks other than 0 (a fake run's one process writes them)."""
    cfg = ctx.cfg
    if not cfg.compile.dump_graphs or not is_lead_process():
        return None
    return f"{cfg.job.dump_folder}/graphs" + (f"/retrace_{retrace}" if retrace else "")


class AotStep:
    """Exports and compiles once per batch signature (shapes and dtypes) and keeps each result, so
    a batch of a shape seen before reuses its graphs and one of a new shape never runs old ones."""

    def __init__(self, ctx: CaptureContext):
        self.ctx = ctx
        self.module = LossModule(ctx.model, ctx.loss_fn, ctx.loss_scale)
        self.pass_names = parameter_passes(ctx.cfg) + activation_passes(ctx.cfg) + get_backend(ctx.cfg.compile.inductor_compilation).pass_names(ctx.cfg.compile.passes)
        self.graphs: dict[tuple, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}
        ctx.stats.setdefault("retraces", 0)

    def _build(self, inputs: torch.Tensor, labels: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        dumper = GraphDumper(dump_folder(self.ctx, len(self.graphs)))
        forward, backward = (StageCompiler(self.ctx, s, self.pass_names, lambda: dumper) for s in ("forward", "backward"))
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            # Keeps `node.meta["custom"]` (regions.py's marks for regional_inductor) on traced nodes.
            stack.enter_context(fx_traceback.preserve_node_meta())
            stack.enter_context(traceable_attention())
            joint = aot_export_joint_with_descriptors(stack, self.module, (inputs, labels))
            t1 = time.perf_counter()
            gm = joint.graph_module
            dumper.dump("joint", gm)
            example = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
            joint.graph_module = apply_passes(gm, self.pass_names, pass_context(self.ctx, gm, example, dumper), "joint")
            t2 = time.perf_counter()
            compiled = aot_compile_joint_with_descriptors(
                joint, partition_fn=min_cut_partition, fw_compiler=forward, bw_compiler=backward
            )
        t3 = time.perf_counter()
        params, buffers = dict(self.module.named_parameters()), dict(self.module.named_buffers())
        state = [params[n] for n in joint.params_spec] + [buffers[n] for n in joint.buffers_spec]
        if self.graphs:
            self.ctx.stats["retraces"] += 1
        # Export and partitioning count as tracing; the joint passes and the stage compilers as compiling.
        stage_s = forward.seconds + backward.seconds
        self.ctx.stats.update(trace_s=(t1 - t0) + (t3 - t2 - stage_s), compile_s=(t2 - t1) + stage_s, graph=dumper.stages)
        report_passes(self.ctx.stats)
        return lambda inputs, labels: compiled(*state, inputs, labels)

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        signature = (tuple(inputs.shape), inputs.dtype, tuple(labels.shape), labels.dtype)
        if signature not in self.graphs:
            self.graphs[signature] = self._build(inputs, labels)
        loss = self.graphs[signature](inputs, labels)
        loss.backward()
        return loss.detach()


@register_capture("aot")
def capture_aot(ctx: CaptureContext) -> AotStep:
    return AotStep(ctx)
