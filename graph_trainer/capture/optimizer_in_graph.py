"""`--compile.optimizer_in_graph`: gradient clipping and the AdamW update traced into the aot_fx_trace
train-step graph, so one graph runs forward, loss, backward, clip and update and the backend compiles
them together (Inductor can fuse each gradient's producer with its update: no gradient buffer left).

Graph: (*params, *buffers, inputs, labels, *exp_avgs, *exp_avg_sqs, lr, step) -> (loss, grad_norm).
Parameters and the two moment states are updated in place (`copy_`), each parameter's as soon as its
update is computed (see `ClipAndAdamWStep`). The
tensors are those of the real `torch.optim.AdamW` the trainer built: its state dict, and so every
checkpoint, is the eager optimizer's, and a run may save with one and resume with the other. The
learning rate (the LR scheduler's, from the parameter group) and the step count are graph inputs
(0-dim float64 tensors), so one graph serves every step.

Numerics follow torch's foreach AdamW without `capturable` (`_multi_tensor_adam`, which the eager
trainer runs on CPU) op for op: the bias corrections and the step size are computed in float64 as it
computes them in Python floats, and each op is the same kernel with its scalar rounded to the
parameter's dtype as the foreach kernels round it. Clipping is the eager step's (clipping.py), whose
cross-rank reduction of the norm is a functional collective in the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.fx.traceback import annotate

from ..blocks import UPDATE_KEY
from ..clipping import clip_coefficient, shards_total_norm
from ..train_step import FunctionalTrainStep
from .fx_trace import TracedStep
from .registry import CaptureContext, register_capture


@dataclass(frozen=True)
class AdamWHyper:
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    max_norm: float
    """Clip to this total norm; inf: report the norm, scale nothing (the coefficient clamps to 1)."""


@dataclass(frozen=True)
class StepScalars:
    """The step's scalars, computed once and shared by every parameter's update. Computed per
    parameter they were ten of the 28 nodes the optimizer added per parameter, paid for by every stage
    before Inductor's scheduler (the trace, the decomposition retrace, AOTAutograd's functionalization,
    lowering) and inlined into every update kernel's code."""

    decay: torch.Tensor
    """1 - lr * weight_decay (float64)."""
    bias_correction2_sqrt: torch.Tensor
    """sqrt(1 - beta2 ** step) (float64)."""
    step_size: dict[torch.dtype, torch.Tensor]
    """-lr / (1 - beta1 ** step), rounded to each parameter dtype as addcdiv's `value` is."""


def step_scalars(lr: torch.Tensor, step: torch.Tensor, dtypes: set[torch.dtype], h: AdamWHyper) -> StepScalars:
    """`lr` and `step` (the count after this step) are float64 scalars, as the Python floats of
    torch's non-capturable AdamW."""
    step_size = (lr / (1 - torch.pow(h.beta1, step))) * -1
    return StepScalars(
        decay=1 - lr * h.weight_decay,
        bias_correction2_sqrt=(1 - torch.pow(h.beta2, step)) ** 0.5,
        step_size={dtype: step_size.to(dtype) for dtype in sorted(dtypes, key=str)},
    )


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 s: StepScalars, h: AdamWHyper) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One parameter's new (param, exp_avg, exp_avg_sq)."""
    param = param * s.decay
    exp_avg = torch.lerp(exp_avg, grad, 1 - h.beta1)
    exp_avg_sq = torch.addcmul(exp_avg_sq * h.beta2, grad, grad, value=1 - h.beta2)
    denom = exp_avg_sq.sqrt() / s.bias_correction2_sqrt + h.eps
    # addcdiv's kernel computes param + (value * exp_avg) / denom with value in the param's dtype.
    return param + exp_avg * s.step_size[param.dtype] / denom, exp_avg, exp_avg_sq


class ClipAndAdamWStep:
    """The traced function: forward + loss + backward, then clip and update in place.

    Clipping needs the norm over every gradient, so no update can start before backward ends; from
    there each parameter is clipped, updated and written back before the next one starts, smallest
    first: the optimizer's part then holds the gradients not yet applied and one update's temporaries,
    the largest only once the other gradients are gone, so that the step's peak can stay in forward
    and backward, where the memory policy can recompute (tests/test_memory_policy.py). (Written back only
    after every update was computed, every new parameter and moment was live at once on top of the
    gradients: a peak past backward that no recomputation could lower.) Backward has read every old
    value by then, so the results are bit for bit those of writing back at the end."""

    def __init__(self, fn: FunctionalTrainStep, hyper: AdamWHyper, ep_enabled: bool):
        self.fn, self.hyper, self.ep_enabled = fn, hyper, ep_enabled
        self.model, self.specs = fn.model, fn.specs

    def __call__(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], inputs: torch.Tensor,
                 labels: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        loss, grads = self.fn(params, buffers, inputs, labels)
        return self.update(params, loss, grads, *state)

    def update(self, params: Sequence[torch.Tensor], loss: torch.Tensor, grads: Sequence[torch.Tensor],
               *state: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """What follows `fn`: `head`, then `update_one` per parameter in `order` (traced so, part by part, where the
        step's blocks are traced from a few: capture/update_tail.py)."""
        n = len(params)
        exp_avgs, exp_avg_sqs, (lr, step) = state[:n], state[n : 2 * n], state[2 * n :]
        with torch.no_grad():
            grads, grad_norm, coef, s = self.head(params, grads, lr, step)
            for i in self.order(params):
                self.update_one(i, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], coef, s.decay, s.bias_correction2_sqrt,
                                s.step_size[params[i].dtype])
        return loss, [grad_norm]

    def head(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], lr: torch.Tensor,
             step: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, StepScalars]:
        """(the gradients in their parameters' dtypes, the total norm, the clip coefficient, the step's scalars)"""
        grads = [g.to(p.dtype) for g, p in zip(grads, params)]
        # As the eager step clips (clipping.py).
        grad_norm = shards_total_norm(self.specs, grads, self.ep_enabled)
        coef = clip_coefficient(grad_norm, self.hyper.max_norm)
        return grads, grad_norm, coef, step_scalars(lr, step, {p.dtype for p in params}, self.hyper)

    @staticmethod
    def order(params: Sequence[torch.Tensor]) -> list[int]:
        return sorted(range(len(params)), key=lambda i: (params[i].numel() * params[i].element_size(), i))

    def update_one(self, i: int, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   coef: torch.Tensor, decay: torch.Tensor, bias_correction2_sqrt: torch.Tensor, step_size: torch.Tensor) -> None:
        """Clip, update and write back parameter `i` and its moments (`step_size`: the step's, in the parameter's dtype)."""
        targets = (param, exp_avg, exp_avg_sq)
        scalars = StepScalars(decay, bias_correction2_sqrt, {param.dtype: step_size})
        with annotate({UPDATE_KEY: i}):
            for target, value in zip(targets, adamw_update(param, grad * coef, exp_avg, exp_avg_sq, scalars, self.hyper)):
                target.copy_(value)


def _adamw(optimizers: Any) -> torch.optim.Optimizer:
    """The one torch AdamW inside torchtitan's optimizer container."""
    inner = list(optimizers)
    assert len(inner) == 1 and isinstance(inner[0], torch.optim.AdamW) and len(inner[0].param_groups) == 1, (
        "optimizer_in_graph updates one AdamW with one parameter group")
    return inner[0]


class OptimizerInGraphStep(TracedStep):
    """aot_fx_trace whose graph also clips and updates; `grad_norm` holds the last call's norm.

    The step counts live where the eager AdamW keeps them (one per parameter, `state["step"]`) and
    are advanced here, outside the graph, as the eager optimizer advances them."""

    def __init__(self, ctx: CaptureContext):
        super().__init__(ctx)
        self.optimizer = _adamw(ctx.optimizers)
        group = self.optimizer.param_groups[0]
        assert not (group["amsgrad"] or group["maximize"]), "optimizer_in_graph has no amsgrad / maximize"
        assert [id(p) for p in group["params"]] == [id(p) for p in self.params], "AdamW holds other parameters than the model"
        max_norm = ctx.cfg.training.max_norm or float("inf")
        hyper = AdamWHyper(*group["betas"], group["eps"], group["weight_decay"], max_norm)
        self.fn = ClipAndAdamWStep(self.fn, hyper, ctx.meshes.degrees.ep > 1)
        self.grad_norm: torch.Tensor | None = None
        self._init_state(group)

    def _init_state(self, group: dict) -> None:
        """The state torch's AdamW creates lazily at its first step (a resumed run has it already)."""
        on_device = group["fused"] or group["capturable"]
        for p in self.params:
            state = self.optimizer.state[p]
            if state:
                continue
            if on_device:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            else:
                scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                state["step"] = torch.tensor(0.0, dtype=scalar, device="cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _states(self) -> list[dict]:
        # Looked up on every call: loading a checkpoint replaces the optimizer's state tensors.
        return [self.optimizer.state[p] for p in self.params]

    def _extra_inputs(self) -> list[torch.Tensor]:
        states = self._states()
        device = self.ctx.device
        lr = torch.tensor(self.optimizer.param_groups[0]["lr"], dtype=torch.float64, device=device)
        step = states[0]["step"].to(device=device, dtype=torch.float64)
        return [*(s["exp_avg"].to_local() for s in states), *(s["exp_avg_sq"].to_local() for s in states), lr, step]

    def _finish(self, out: Sequence[torch.Tensor]) -> torch.Tensor:
        self.grad_norm = out[1]
        return out[0]

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for state in self._states():
                state["step"] += 1
        return super().__call__(inputs, labels)


@register_capture("aot_fx_trace")
def capture_fx_trace(ctx: CaptureContext) -> TracedStep:
    """The mode's entry lives here, above both step classes: fx_trace's plain step knows nothing of
    the in-graph optimizer."""
    if ctx.cfg.compile.optimizer_in_graph:
        return OptimizerInGraphStep(ctx)
    return TracedStep(ctx)
