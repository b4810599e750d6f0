"""The trainer's pipeline-parallel step (`--parallelism.pp`): the rank's stages (parallel/pipeline.py),
run eagerly or as traced graphs (capture/pipeline_stage.py), under torch's schedule; and the total
gradient norm over every stage."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .capture.registry import CaptureContext
from .clipping import is_expert_grad, join_norms
from .parallel.compat import declared_stage_shapes
from .parallel.fake_data import FakeNeighbours
from .parallel.mesh import Meshes
from .parallel.pipeline import PipelineLayout, PipelineStep, StageIO, build_schedule, pipeline_total_norm, stage_grads, stage_views
from .parallel.step_gather import StepGather
from .passes import compile_workers

TRACED_MODES = ("aot_fx_trace", "aot")
logger = logging.getLogger("graph_trainer")


class Pipeline:
    """The rank's stages and schedule: `step` is the Step the trainer calls per gradient-accumulation
    microbatch (its batch is split again into the schedule's microbatches), `total_norm` the gradient
    norm over every stage of the job."""

    def __init__(self, ctx: CaptureContext, layout: PipelineLayout, model_args: Any, microbatch: int, dtype: torch.dtype):
        self.layout = layout
        ctx.stats["pp_stage_layers"] = ",".join(str(len(layers)) for layers in layout.layers)
        self.meshes: Meshes = ctx.meshes
        assert self.meshes.pp is not None
        self.pp_rank = self.meshes.pp.get_local_rank()
        self.views = stage_views(ctx.model, layout, self.pp_rank)
        modules: list[nn.Module] = self.views
        traced = []
        if ctx.cfg.compile.mode in TRACED_MODES:
            from .capture.pipeline_stage import TracedStage

            modules = traced = [TracedStage(v, s, ctx) for v, s in zip(self.views, layout.stages_of(self.pp_rank))]
        if ctx.cfg.comm.mode == "fake":
            last = layout.num_stages - 1
            modules = [FakeNeighbours(m, s == 0, s == last) for m, s in zip(modules, layout.stages_of(self.pp_rank))]
        scale = ctx.loss_scale / layout.microbatches
        loss_fn = ctx.loss_fn

        def scaled_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return loss_fn(output, labels) * scale

        # an auto-placed stage hands on its output in the token batch's layout, whole sequences (autoparallel.entry)
        sequence_shards = 1 if ctx.cfg.compile.autoparallel else self.meshes.degrees.tp
        io = StageIO(microbatch, ctx.cfg.training.seq_len, model_args.dim, model_args.vocab_size, dtype, sequence_shards)
        schedule = build_schedule(modules, layout, self.meshes.pp, ctx.device, scaled_loss, io)
        if ctx.cfg.comm.mode == "fake":
            declared_stage_shapes(schedule)
        gather = StepGather(ctx.model) if ctx.cfg.parallelism.pp_gather == "step" else None

        def compile_stages() -> None:
            t0 = time.perf_counter()
            with compile_workers.lent(traced[0].pass_names, ctx.cfg, ctx.device):
                for stage in traced:
                    stage.compile_for(io.input(stage.stage_index, ctx.device))
            ctx.stats["pp_stages_compiled_first"] = len(traced)
            logger.info(f"compiled this rank's {len(traced)} pipeline stages before the first schedule: {time.perf_counter() - t0:.1f} s")

        self.step = PipelineStep(schedule, layout, self.meshes.pp, ctx.device, gather or contextlib.nullcontext,
                                 compile_stages if traced else None)
        self.ep_enabled = self.meshes.degrees.ep > 1
        self.device = ctx.device

    def sum_over_ranks(self, value: torch.Tensor | None) -> torch.Tensor:
        """A per-rank count (None: this rank has none) summed over the pipeline ranks."""
        total = torch.zeros((), dtype=torch.float64, device=self.device) if value is None else value.clone()
        dist.all_reduce(total, group=self.meshes.pp.get_group())
        return total

    def total_norm(self) -> torch.Tensor:
        """Over every stage; with expert parallelism the expert and the other gradients apart, combined (clipping.total_norm)."""
        if not self.ep_enabled:
            return pipeline_total_norm(stage_grads(self.views, self.layout, self.pp_rank), self.meshes.pp, self.meshes.dense)
        ep = pipeline_total_norm(stage_grads(self.views, self.layout, self.pp_rank, is_expert_grad), self.meshes.pp,
                                 self.meshes.sparse)
        dense = pipeline_total_norm(stage_grads(self.views, self.layout, self.pp_rank, lambda g: not is_expert_grad(g)),
                                    self.meshes.pp, self.meshes.dense)
        return join_norms(ep, dense)
