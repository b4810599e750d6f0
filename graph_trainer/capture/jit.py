"""jit mode: `torch.compile` of model + loss with our own AOTAutograd backend.

Dynamo captures `LossModule` (the model, the loss and its scale) on the first call; AOTAutograd
traces the joint graph, `min_cut_rematerialization_partition` splits it, and our forward and
backward compilers (`aot.StageCompiler`) dump each graph and run the registered passes of its
stage before the graph runs. Backward is plain `loss.backward()` through the compiled module, so
autograd adds the DTensor gradients into `param.grad` as in eager mode.

Whole model, not per transformer block, because:
- the collective passes (bucketing, reordering, prefetching the next block's all-gather) need the
  all-gathers and reduce-scatters of every block in one graph; per-block graphs would hide every
  cross-block decision from them;
- the loss and the output projection join the same graph, so one backward graph covers the step;
- it works unchanged for every placement: the SimpleFSDP gathers are attribute reads that Dynamo
  inlines (the DTensor redistribute and `to_local(grad_placements=...)` become AOTAutograd
  collectives), TP's DTensor modules trace as DTensor ops, and EP's dispatch has routing-independent
  shapes, so each is one forward and one backward graph (checked: llama3 dp_shard=2 and tp=2,
  DeepSeek V3 dp_shard=2 ep=2); what Dynamo cannot capture graph-breaks into several graphs, each
  through the same compilers, instead of failing.
The price is a compile that grows with depth (each block is traced, none is reused), which the
whole-model aot and aot_fx_trace modes pay as well.

Shapes are static (`dynamic=False`): a batch of another shape is recompiled by Dynamo; a call
that compiled new graphs after the first counts in `stats["retraces"]`. `trace_s` is that call's
wall time less the time in our compilers (`compile_s`) and in the graphs they returned.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import fx, nn

from graph_trainer.backends import get_backend

from ..graph_dump import GraphDumper
from ..passes.collectives import find_collectives
from ..passes.registry import apply_passes
from ..passes.reshard import parameter_passes
from .registry import CaptureContext, register_capture
from .aot import LossModule, StageCompiler, dump_folder, pass_context
from .compat import aot_autograd, min_cut_partition


class JitStep:
    def __init__(self, ctx: CaptureContext):
        self.ctx = ctx
        names = get_backend(ctx.cfg.compile.inductor_compilation).pass_names(ctx.cfg.compile.passes)
        self.compilers = [StageCompiler(ctx, stage, names, self._dumper) for stage in ("forward", "backward")]
        backend = aot_autograd(
            fw_compiler=self.compilers[0],
            bw_compiler=self.compilers[1],
            partition_fn=self._partition,
        )
        self.module = torch.compile(LossModule(ctx.model, ctx.loss_fn, ctx.loss_scale), backend=backend, dynamic=False)
        self.captures = 0
        self.dumper: GraphDumper | None = None
        ctx.stats.setdefault("retraces", 0)

    def _partition(self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        """The joint-stage passes (the parameter policy's partitioner tags), then the min-cut partition."""
        ctx = pass_context(self.ctx, joint, joint_inputs, self._dumper())
        # Only this pass reads names of inputs that are not leading: `num_params` stays as counted.
        ctx = dataclasses.replace(ctx, param_fqns=_gathered_param_names(joint, self.ctx.model))
        joint = apply_passes(joint, parameter_passes(self.ctx.cfg), ctx, "joint")
        return min_cut_partition(joint, joint_inputs, **kwargs)

    def _dumper(self) -> GraphDumper:
        """One dumper per call that compiles, created by the first graph that call compiles."""
        if self.dumper is None:
            self.dumper = GraphDumper(dump_folder(self.ctx, self.captures))
        return self.dumper

    def _totals(self) -> tuple[int, float, float]:
        return (
            sum(c.calls for c in self.compilers),
            sum(c.seconds for c in self.compilers),
            sum(c.run_seconds for c in self.compilers),
        )

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        calls, compile_s, run_s = self._totals()
        t0 = time.perf_counter()
        loss = self.module(inputs, labels)
        loss.backward()
        wall = time.perf_counter() - t0
        new_calls, new_compile_s, new_run_s = self._totals()
        if new_calls != calls:
            if self.captures:
                self.ctx.stats["retraces"] += 1
            self.captures += 1
            compile_s = new_compile_s - compile_s
            assert self.dumper is not None
            self.ctx.stats.update(trace_s=wall - compile_s - (new_run_s - run_s), compile_s=compile_s, graph=self.dumper.stages)
            self.dumper = None
        return loss.detach()


def _gathered_param_names(joint: fx.GraphModule, model: nn.Module) -> list[str]:
    """A parameter FQN per joint-graph input ('' for the others).

    Dynamo hands AOTAutograd the parameters as unnamed inputs. Forward gathers each parameter when its
    module runs, so the inputs the FSDP all-gathers read, in order of first gather, are the parameters
    block by block in the model's order (within a module the order may differ, which the policy,
    decided per block, does not read). Any other count of gathered inputs leaves all unnamed.
    """
    placeholders = list(joint.graph.find_nodes(op="placeholder"))
    names = [""] * len(placeholders)
    gathered = dict.fromkeys(c.placeholder for c in find_collectives(joint) if c.kind == "all_gather" and c.placeholder is not None)
    fqns = [n for n, p in model.named_parameters() if p.requires_grad]
    if len(gathered) == len(fqns):
        index = {ph: i for i, ph in enumerate(placeholders)}
        for ph, fqn in zip(gathered, fqns):
            names[index[ph]] = fqn
    return names


@register_capture("jit")
def capture_jit(ctx: CaptureContext) -> JitStep:
    return JitStep(ctx)
