"""Trace the train step of any model size on a fake process group: no GPUs, no real ranks, no
parameter memory. The model stays on the meta device; only shapes flow through the trace.

This is what plan-only runs and graph inspection of 8B/70B configs on a CPU machine build on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import fx

from .. import models
from ..blocks import annotate_blocks
from ..config import JobConfig
from ..parallel import apply_activation_checkpointing
from ..parallel.compat import init_fake_process_group
from ..parallel.mesh import Meshes, build_meshes, resolve_degrees
from ..train_step import FunctionalTrainStep, named_buffers
from .fx_trace import trace_train_step


@dataclass
class FakeTrace:
    graph: fx.GraphModule
    meshes: Meshes
    model: torch.nn.Module
    trace_s: float


def trace_on_fake_mesh(cfg: JobConfig, world_size: int) -> FakeTrace:
    """Place the model as `train` would (manual or solver plan), then trace one microbatch on fake tensors."""
    from ..data.tokenizer import separator_of
    from ..placement import place_model
    from ..losses import cross_entropy
    from ..parallel.simple_fsdp import MixedPrecision

    init_fake_process_group(world_size)
    p, t = cfg.parallelism, cfg.training
    degrees = resolve_degrees(p.dp_replicate, p.dp_shard, p.tp, p.ep, world_size)
    meshes = build_meshes(degrees, "cpu")
    spec = models.get_spec(cfg.model.name)
    args = spec.job_args(cfg)
    device = torch.device("cpu")
    # Plans are for the GPU: "auto" precision resolves as it would there.
    mp = MixedPrecision.from_config(cfg.training, "cuda")
    model = annotate_blocks(place_model(models.build_to_place(spec, args, "cpu", separator_of(cfg.model.tokenizer_path), models.stored_dtype(cfg)),
                                        spec, args, meshes, mp, cfg))
    apply_activation_checkpointing(model, cfg)
    local_batch = t.batch_size // (degrees.dp * t.gradient_accumulation_steps)
    step = FunctionalTrainStep(model, cross_entropy, 1.0 / t.gradient_accumulation_steps)
    params = [q.to_local() for q in model.parameters() if q.requires_grad]
    _, buffers = named_buffers(model)
    tokens = torch.empty(local_batch, t.seq_len, dtype=torch.long, device="meta")
    start = time.perf_counter()
    graph = trace_train_step(step, params, buffers, tokens, tokens, device)
    return FakeTrace(graph, meshes, model, time.perf_counter() - start)
