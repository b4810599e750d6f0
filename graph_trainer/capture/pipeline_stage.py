"""A pipeline stage's forward and backward as traced graphs (`--parallelism.pp` with --compile.mode
aot_fx_trace or aot).

A schedule runs a microbatch's forward and its backward at different slots, interleaved with other
microbatches and stages, so a stage cannot be one forward+backward graph as the whole step is: each
stage's joint graph is exported (`aot_export_joint_with_descriptors` on the stage module and one
microbatch of its input), partitioned by the min-cut partitioner into a forward and a backward graph,
and both go through the job's passes and backend (aot.py's StageCompiler) before
`aot_compile_joint_with_descriptors` returns an autograd function. The schedule's stage calls it as
its module: the forward graph runs at a forward slot, the backward graph when the schedule
backpropagates the stage's output gradient; the parameters' gradients add into `param.grad`.

The loss on the last stage runs eagerly after the stage's graph (the schedule calls it on the stage
output). Shapes are baked in: a microbatch of a new shape exports again (`stats["retraces"]`). The pipeline
compiles every local stage for its declared input before its first schedule runs (`compile_for`), so that the
ranks compile at the same time: compiled at their first microbatch, a stage waited for the previous rank's
stage to compile and send its first activations. With
FSDP each microbatch gathers the stage's parameters again in its forward graph (and reduce-scatters
its gradients in its backward graph).
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Callable

import torch
from torch import nn
from torch.fx import traceback as fx_traceback

from graph_trainer.backends import get_backend

from ..graph_dump import GraphDumper
from ..models import traceable_attention
from ..parallel.pipeline import SPLIT_BACKWARD
from ..passes.memory_policy import activation_passes
from ..passes.reshard import parameter_passes
from ..passes.registry import apply_passes
from .aot import StageCompiler, dump_folder, pass_context, report_passes
from .backward_split import SplitBackwardCompiler
from .compat import aot_compile_joint_with_descriptors, aot_export_joint_with_descriptors, min_cut_partition
from .registry import CaptureContext


class _Owner(nn.Module):
    """Holds the stage under `model.`, the prefix aot.pass_context drops to name parameters by FQN."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.model = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class TracedStage(nn.Module):
    """The module a PipelineStage runs: the stage's compiled forward graph, differentiable through its
    compiled backward graph."""

    def __init__(self, stage: nn.Module, stage_index: int, ctx: CaptureContext):
        super().__init__()
        self.owner = _Owner(stage)
        self.stage_index = stage_index
        self.ctx = ctx
        cfg = ctx.cfg
        self.pass_names = parameter_passes(cfg) + activation_passes(cfg) + get_backend(cfg.compile.inductor_compilation).pass_names(cfg.compile.passes)
        self.graphs: dict[tuple, Callable[[torch.Tensor], torch.Tensor]] = {}
        ctx.stats.setdefault("retraces", 0)
        self.split = cfg.parallelism.pp_schedule in SPLIT_BACKWARD
        self.weight_gradients: collections.deque[Callable[[], None]] = collections.deque()
        """Zero-bubble schedules: each backward's weight-gradient part, waiting for the schedule's W slot."""

    def dw_builder(self) -> Callable[[], None]:
        """PipelineStage's hook for the zero-bubble schedules: the weight-gradient part of the backward that just ran."""
        return self.weight_gradients.popleft()

    def _build(self, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        folder = dump_folder(self.ctx, len(self.graphs))
        dumper = GraphDumper(f"{folder}/stage_{self.stage_index}" if folder else None)
        forward, backward = (StageCompiler(self.ctx, s, self.pass_names, lambda: dumper) for s in ("forward", "backward"))
        state: list[torch.Tensor] = []
        bw_compiler = SplitBackwardCompiler(backward, lambda: state, self.weight_gradients) if self.split else backward
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            stack.enter_context(fx_traceback.preserve_node_meta())
            stack.enter_context(traceable_attention())
            joint = aot_export_joint_with_descriptors(stack, self.owner, (x,))
            gm = joint.graph_module
            dumper.dump("joint", gm)
            example = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
            joint.graph_module = apply_passes(gm, self.pass_names, pass_context(self.ctx, gm, example, dumper), "joint")
            params, buffers = dict(self.owner.named_parameters()), dict(self.owner.named_buffers())
            state += [params[n] for n in joint.params_spec] + [buffers[n] for n in joint.buffers_spec]
            compiled = aot_compile_joint_with_descriptors(joint, partition_fn=min_cut_partition, fw_compiler=forward, bw_compiler=bw_compiler)
        if self.graphs:
            self.ctx.stats["retraces"] += 1
        stats = self.ctx.stats
        stats["trace_s"] = stats.get("trace_s", 0.0) + time.perf_counter() - t0 - forward.seconds - backward.seconds
        stats["compile_s"] = stats.get("compile_s", 0.0) + forward.seconds + backward.seconds
        report_passes(stats)
        return lambda x: compiled(*state, x)

    def compile_for(self, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The compiled stage for inputs like `x` (its values unread), traced and compiled on the first such input."""
        signature = (tuple(x.shape), x.dtype, x.requires_grad)
        if signature not in self.graphs:
            self.graphs[signature] = self._build(x)
        return self.graphs[signature]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.compile_for(x)(x)
