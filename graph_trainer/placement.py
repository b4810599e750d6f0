"""Placement of a meta-device model on the mesh: the manual SimpleFSDP/TP/EP plan, or the one the
auto-sharding solver picks (`--compile.autoparallel`). The trainer calls only `place_model`."""

from __future__ import annotations

from typing import Any

from torch import nn

from .config import JobConfig
from .models import ModelSpec
from .parallel import parallelize
from .parallel.mesh import Meshes
from .parallel.simple_fsdp import MixedPrecision


def place_model(model: nn.Module, spec: ModelSpec, args: Any, meshes: Meshes, mp: MixedPrecision, cfg: JobConfig) -> nn.Module:
    if cfg.compile.autoparallel:
        from .autoparallel.entry import place

        return place(model, spec, args, meshes, mp, cfg)
    return parallelize(model, spec, meshes, mp, cfg.parallelism.moe_capacity_factor)
