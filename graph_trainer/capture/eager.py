"""Eager mode: the model runs op by op and autograd fills `param.grad` (the reference for parity).
`--parallelism.reshard_after_forward` acts through autograd's saved-tensor hooks, and parameters gather
without DTensor's per-call redistribute planning (simple_fsdp.direct_gathers)."""

from __future__ import annotations

import torch

from ..parallel.simple_fsdp import direct_gathers, reshard_after_forward
from .registry import CaptureContext, register_capture


class EagerStep:
    def __init__(self, ctx: CaptureContext):
        self.ctx = ctx

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with direct_gathers(), reshard_after_forward(self.ctx.model, self.ctx.cfg.parallelism.reshard_after_forward):
            loss = self.ctx.loss_fn(self.ctx.model(inputs), labels)
            if self.ctx.loss_scale != 1.0:
                loss = loss * self.ctx.loss_scale
            loss.backward()
        return loss.detach()


@register_capture("eager")
def capture_eager(ctx: CaptureContext) -> EagerStep:
    return EagerStep(ctx)
