"""The one registry of graph passes. A pass is `fn(gm, ctx) -> gm` plus a declaration whose
constraints are data: the validator reads them before anything heavy runs, and every mode and
backend applies passes only through `apply_passes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
from torch import fx

Stage = Literal["joint", "forward", "backward", "train_step"]


@dataclass
class PassContext:
    """What a pass may read: the config, meshes, example inputs of the graph, the dumper."""

    cfg: Any
    meshes: Any
    device: torch.device
    example_inputs: list[Any] = field(default_factory=list)
    dumper: Any = None
    num_params: int = 0
    """How many leading graph inputs are parameter shards (static addresses for cudagraph)."""
    num_buffers: int = 0
    param_fqns: list[str] = field(default_factory=list)


PassFn = Callable[[fx.GraphModule, PassContext], Any]


@dataclass(frozen=True)
class PassSpec:
    name: str
    description: str
    stages: tuple[Stage, ...]
    modes: tuple[str, ...]
    fn: PassFn
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    must_be_last: bool = False
    cuda_only: bool = False
    compiles: bool = False
    """The pass returns a compiled callable, not a GraphModule: no graph pass may follow it."""


PASSES: dict[str, PassSpec] = {}


def register_pass(spec: PassSpec) -> PassSpec:
    assert spec.name not in PASSES, spec.name
    PASSES[spec.name] = spec
    return spec


def load_passes() -> dict[str, PassSpec]:
    from . import builtin  # noqa: F401  (registers every pass the package ships)

    return PASSES


def apply_passes(gm: fx.GraphModule, names: list[str], ctx: PassContext, stage: Stage) -> Any:
    """Run the named passes in order on one graph of `stage`, dumping after each."""
    passes = load_passes()
    result: Any = gm
    for name in names:
        spec = passes[name]
        if stage not in spec.stages:
            continue
        result = spec.fn(result, ctx)
        if ctx.dumper is not None and isinstance(result, fx.GraphModule):
            ctx.dumper.dump(f"{stage}_{name}" if stage != "train_step" else name, result)
    return result
