"""Placement of a meta-device model on the mesh: the manual SimpleFSDP/TP/EP plan, or the one the
auto-sharding solver picks (`--compile.autoparallel`). The trainer calls `place_model`, then
`write_placements` for the record that `graph-trainer compare` diffs between runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor

from .config import JobConfig
from .models import ModelSpec
from .parallel import parallelize
from .parallel.mesh import Meshes
from .parallel.pipeline import PipelineLayout, forward_batch
from .parallel import vocab_embedding
from .parallel.simple_fsdp import MixedPrecision
from .passes.ep_overlap import moe_chunks


def place_model(model: nn.Module, spec: ModelSpec, args: Any, meshes: Meshes, mp: MixedPrecision, cfg: JobConfig,
                layout: PipelineLayout | None = None, build: Callable[[], nn.Module] | None = None) -> nn.Module:
    """`layout`: the pipeline's stages, of which `model` holds this rank's; `build`: a whole meta-device model
    like `model` was before pruning (the solver plans every stage: autoparallel.entry.place)."""
    if cfg.compile.autoparallel:
        from .autoparallel.entry import place

        return place(model, spec, args, meshes, mp, cfg, layout, build)
    return parallelize(model, spec, meshes, mp, cfg.parallelism.moe_capacity_factor, moe_chunks(cfg),
                       embedding_by_vocab(cfg, meshes, args.vocab_size))


def embedding_by_vocab(cfg: JobConfig, meshes: Meshes, vocab: int) -> bool:
    """Whether this job reads its token embedding in place (`--parallelism.embedding`)."""
    d = meshes.degrees
    tokens = forward_batch(cfg.training, cfg.parallelism, d.dp) * cfg.training.seq_len
    return vocab_embedding.chosen(cfg.parallelism.embedding, d, vocab, tokens, cfg.compile.autoparallel, meshes.dense.device_type)


def describe_placements(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Each parameter's storage layout by FQN: mesh dim names, mesh shape, placements (`Shard(dim=0)`).
    Activation-checkpoint wrappers are left out of the FQNs so that runs with and without AC compare."""
    described = {}
    for fqn, param in model.named_parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            layout = {"mesh_dim_names": list(mesh.mesh_dim_names or ()), "mesh_shape": list(mesh.shape),
                      "placements": [repr(p) for p in param.placements]}
        else:
            layout = {"mesh_dim_names": [], "mesh_shape": [], "placements": []}
        described[fqn.replace(_CHECKPOINT_PREFIX, "")] = layout
    return described


def write_placements(model: nn.Module, dump_folder: str) -> Path:
    path = Path(dump_folder) / "placements.json"
    path.write_text(json.dumps(describe_placements(model), indent=1) + "\n")
    return path
