"""The train step as a pure function: (local parameter shards, buffers, inputs, labels) -> (loss, grads).

Every capture mode that traces works on this function: its inputs and outputs are plain tensors (the
local shards of the sharded parameters), so the traced graph holds the data-parallel collectives as
ops and knows nothing of DTensor. Inside, the shards are wrapped back into DTensors and the model runs
exactly as in eager mode, which is what makes the traced step bitwise equal to eager.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ParamSpec:
    """How one local shard maps back to its DTensor parameter."""

    fqn: str
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def wrap(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride)


def param_specs(model: nn.Module) -> list[ParamSpec]:
    return [
        ParamSpec(n, p.device_mesh, tuple(p.placements), p.shape, p.stride())
        for n, p in model.named_parameters()
        if p.requires_grad
    ]


def local_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local() for p in model.parameters() if p.requires_grad]


def named_buffers(model: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    names, tensors = zip(*model.named_buffers()) if list(model.buffers()) else ((), ())
    return list(names), list(tensors)


@contextlib.contextmanager
def swapped_tensors(model: nn.Module, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """Put other tensors in the model's parameter/buffer slots for one call, then restore them."""
    saved = []
    for fqn, value in values.items():
        owner_name, _, name = fqn.rpartition(".")
        owner = model.get_submodule(owner_name)
        slot = owner._parameters if name in owner._parameters else owner._buffers
        saved.append((slot, name, slot[name]))
        slot[name] = value
    try:
        yield
    finally:
        for slot, name, value in saved:
            slot[name] = value


class FunctionalTrainStep:
    """Forward + loss + backward of one microbatch as a function of plain tensors.

    `loss_scale` divides the loss before backward (1 / gradient accumulation steps), so the
    gradients of several microbatches add up to the gradient of their mean loss.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, loss_scale: float = 1.0):
        self.model = model
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.specs = param_specs(model)
        self.buffer_names, _ = named_buffers(model)

    def __call__(
        self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        dparams = {s.fqn: s.wrap(p) for s, p in zip(self.specs, params)}
        # Backward stays inside the swap: activation checkpointing re-runs module forwards there.
        with swapped_tensors(self.model, {**dparams, **dict(zip(self.buffer_names, buffers))}):
            loss = self.loss_fn(self.model(inputs), labels)
            if self.loss_scale != 1.0:
                loss = loss * self.loss_scale
            grads = torch.autograd.grad(loss, list(params), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else _laid_out_like(g, p) for p, g in zip(params, grads)]
        return loss.detach(), grads


def _laid_out_like(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The gradient with its parameter's strides, as autograd's AccumulateGrad lays out `param.grad`.

    A gradient that comes out transposed (the MoE experts' do) holds the same values, but the norm
    that clipping takes of it sums in another order: eager and traced runs would drift apart.
    """
    if grad.stride() == param.stride():
        return grad
    return torch.empty_strided(param.shape, param.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)


def accumulate_grads(params: Sequence[torch.Tensor], specs: Sequence[ParamSpec], grads: Sequence[torch.Tensor]) -> None:
    """Add local gradient shards into `param.grad` as DTensors laid out like their parameters."""
    for p, spec, g in zip(params, specs, grads):
        g = g.to(p.dtype)
        if p.grad is None:
            p.grad = spec.wrap(g)
        else:
            p.grad.to_local().add_(g)
