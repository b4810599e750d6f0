"""Capture modes: each turns the model + loss into a `Step` the trainer calls once per microbatch.

A mode registers itself here by name; the trainer looks it up and never branches on which it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import nn

from ..config import JobConfig
from ..parallel.mesh import Meshes
from ..train_step import LossFn


@dataclass
class CaptureContext:
    cfg: JobConfig
    meshes: Meshes
    model: nn.Module
    loss_fn: LossFn
    loss_scale: float
    device: torch.device
    stats: dict[str, Any] = field(default_factory=dict)
    """What the capture reports for the log: trace/compile seconds, retraces, graph summary."""
    optimizers: Any = None
    """The trainer's optimizer (torchtitan's container): a step that updates the parameters itself
    (`--compile.optimizer_in_graph`) reads and writes its state."""


class Step(Protocol):
    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Run forward + loss + backward of one microbatch; add the gradients into `param.grad`."""


def own_grad_norm(step: Step) -> torch.Tensor | None:
    """The gradient norm of the last call of a step that also clipped the gradients and updated the
    parameters (its `grad_norm` attribute; it leaves no `param.grad`), or None for a step that leaves
    clipping and the optimizer step to the trainer."""
    return getattr(step, "grad_norm", None)


CaptureFn = Callable[[CaptureContext], Step]
_CAPTURES: dict[str, CaptureFn] = {}


def register_capture(name: str) -> Callable[[CaptureFn], CaptureFn]:
    def deco(fn: CaptureFn) -> CaptureFn:
        _CAPTURES[name] = fn
        return fn

    return deco


def build_step(mode: str, ctx: CaptureContext) -> Step:
    from . import eager  # noqa: F401  (each module registers its mode on import)
    from . import fx_trace  # noqa: F401
    from . import jit  # noqa: F401
    from . import aot  # noqa: F401

    return _CAPTURES[mode](ctx)
