"""What a capture mode is and where it registers: the context it builds a step from, the step it
returns, and the registry the trainer looks modes up in (through `build_step`). The mode modules
import this, never the package, so the package may import them without a cycle."""

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
CAPTURES: dict[str, CaptureFn] = {}


def register_capture(name: str) -> Callable[[CaptureFn], CaptureFn]:
    def deco(fn: CaptureFn) -> CaptureFn:
        CAPTURES[name] = fn
        return fn

    return deco
