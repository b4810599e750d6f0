"""A train step traced in this process on meta tensors, as a job of several ranks traces it (rank 0,
torch's fake process group), for graph-level tests of the passes that work on parallel collectives."""

from __future__ import annotations

import torch
from torch import fx

from graph_trainer import models
from graph_trainer.blocks import annotate_blocks
from graph_trainer.capture.fx_trace import trace_train_step
from graph_trainer.config import parse_args
from graph_trainer.losses import cross_entropy
from graph_trainer.parallel.mesh import build_meshes, resolve_degrees
from graph_trainer.parallel.simple_fsdp import MixedPrecision
from graph_trainer.passes.registry import PassContext
from graph_trainer.placement import place_model
from graph_trainer.train_step import FunctionalTrainStep, named_buffers

SEQ_LEN = 64


def trace_step(model: str, dp_shard: int, tp: int, ep: int, *flags: str, batch: int = 4) -> tuple[fx.GraphModule, PassContext]:
    """The debug model's step with a global batch of `batch` (needs a fake process group of dp_shard * tp ranks)."""
    cfg = parse_args(["--model.name", model, "--compile.mode", "aot_fx_trace", "--parallelism.dp_shard", str(dp_shard),
                      "--parallelism.tp", str(tp), "--parallelism.ep", str(ep), *flags])
    meshes = build_meshes(resolve_degrees(1, dp_shard, tp, ep, dp_shard * tp), "cpu")
    spec = models.get_spec(model)
    args = spec.args_for(cfg.model.flavor, SEQ_LEN, cfg.model.n_layers)
    placed = place_model(models.build_on_meta(spec, args, "cpu"), spec, args, meshes,
                         MixedPrecision(torch.float32, torch.float32), cfg)
    annotate_blocks(placed)
    step = FunctionalTrainStep(placed, cross_entropy)
    params = [p.to_local() for p in placed.parameters()]
    _, buffers = named_buffers(placed)
    tokens = torch.zeros(batch // dp_shard, SEQ_LEN, dtype=torch.long, device="meta")
    gm = trace_train_step(step, params, buffers, tokens, tokens, torch.device("cpu"))
    ctx = PassContext(cfg=cfg, meshes=meshes, device=torch.device("cpu"), num_params=len(params),
                      num_buffers=len(buffers), param_fqns=[s.fqn for s in step.specs])
    return gm, ctx
