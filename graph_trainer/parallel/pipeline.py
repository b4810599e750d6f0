"""Pipeline parallelism: the transformer layers split into stages over the `pp` mesh dimension and run
by torch.distributed.pipelining's schedules (1F1B, GPipe, Interleaved1F1B, InterleavedZeroBubble).

A pipeline rank holds ONE module with the layers of all its stages under the whole model's FQNs
(torchtitan's split: blocks of other stages deleted from `layers`, the embedding, final norm and
output set to None where another stage owns them), so the checkpointer, the optimizer and the
placement record key by FQN as without pipelining, and a checkpoint loads on any pp degree. Each
local stage is a view of that module that shares its blocks (`stage_views`). Stages are placed
round-robin over the pp ranks (stage s on pp rank s % pp), which the looped schedules expect.

Bitwise parity with pp 1: the schedules' microbatches are the ones gradient accumulation would make
(the trainer feeds them in the same order), each microbatch's loss is scaled by 1 / microbatches as
gradient accumulation scales it (the schedule's own gradient scaling is off), and the gradient norm
reduces the per-tensor norms of every stage in the whole model's order (`pipeline_total_norm`).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..config import Parallelism, Training

SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe", "InterleavedZeroBubble")
LOOPED = ("Interleaved1F1B", "InterleavedZeroBubble")
"""Schedules that run several stages per rank (torch's PipelineScheduleMulti)."""
SPLIT_BACKWARD = ("InterleavedZeroBubble",)
"""Schedules that split backward into input- and weight-gradient passes."""
EDGE_MODULES = ("tok_embeddings", "norm", "output")


def stages_per_rank(schedule: str, asked: int) -> int:
    return asked or (2 if schedule in LOOPED else 1)


def min_microbatches(schedule: str, pp: int) -> int:
    """GPipe runs any number; the 1F1B family needs one microbatch in flight per pipeline rank."""
    return 1 if schedule == "GPipe" else pp


def default_microbatches(pp: int, stages_per_rank_: int) -> int:
    return pp * stages_per_rank_


def microbatches_of(p: Parallelism) -> int:
    """Schedule microbatches per gradient-accumulation step (1 without pipelining)."""
    if p.pp == 1:
        return 1
    return p.pp_microbatches or default_microbatches(p.pp, stages_per_rank(p.pp_schedule, p.pp_stages_per_rank))


def forward_batch(t: Training, p: Parallelism, dp: int) -> int:
    """Sequences one forward of a rank reads: the global batch over the `dp` data-parallel ranks, the
    gradient-accumulation steps and the schedule's microbatches."""
    return t.batch_size // (dp * t.gradient_accumulation_steps * microbatches_of(p))


def split_layers(n_layers: int, num_stages: int, per_stage: Sequence[int] | None) -> tuple[tuple[int, ...], ...]:
    """Transformer layer indices of each stage: `per_stage` counts, or an even split. ValueError names
    what does not fit."""
    if per_stage:
        if len(per_stage) != num_stages:
            raise ValueError(f"{len(per_stage)} layer counts given for {num_stages} stages; give one count per stage")
        if any(n < 0 for n in per_stage) or sum(per_stage) != n_layers:
            raise ValueError(f"the layer counts {','.join(map(str, per_stage))} must be >= 0 and add up to the model's {n_layers} layers")
        counts = list(per_stage)
    else:
        if n_layers % num_stages:
            raise ValueError(f"{n_layers} layers do not split evenly into {num_stages} stages; pick a pp * stages per rank that divides "
                             f"{n_layers}, or give --parallelism.pp_layers_per_stage")
        counts = [n_layers // num_stages] * num_stages
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return tuple(tuple(range(start, start + n)) for start, n in zip(starts, counts))


BALANCED = "balanced"
"""`--parallelism.pp_layers_per_stage balanced`: the split `balanced_counts` chooses from each layer's cost."""


def balanced_counts(layer_costs: Sequence[float], first_extra: float, last_extra: float, pp: int, num_stages: int) -> list[int]:
    """Layer counts per stage that balance the work of each pipeline RANK first (a rank's stages run one after
    another, so the busiest rank sets the step), then of each stage (a stage's neighbours wait for it): the first
    stage also does `first_extra` (the embedding), the last `last_extra` (final norm, output projection and loss),
    which is as much as two 8B layers. Starts from the boundaries nearest the even shares of the total cost and
    moves one boundary by one layer while that lowers (busiest rank, busiest stage)."""
    n = len(layer_costs)
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)
    total = prefix[-1] + first_extra + last_extra

    def nearest(share: float) -> int:
        return min(range(n + 1), key=lambda j: abs(first_extra + prefix[j] - share))

    bounds = [0] + [nearest(total * k / num_stages) for k in range(1, num_stages)] + [n]
    for k in range(1, num_stages + 1):
        bounds[k] = max(bounds[k], bounds[k - 1])

    def key(b: list[int]) -> tuple[float, float]:
        stage = [prefix[b[k + 1]] - prefix[b[k]] for k in range(num_stages)]
        stage[0] += first_extra
        stage[-1] += last_extra
        ranks = [sum(stage[r::pp]) for r in range(pp)]
        return max(ranks), max(stage)

    best = key(bounds)
    improved = True
    while improved:
        improved = False
        for k in range(1, num_stages):
            for step in (-1, 1):
                moved = list(bounds)
                moved[k] += step
                if not bounds[k - 1] <= moved[k] <= bounds[k + 1]:
                    continue
                if key(moved) < best:
                    bounds, best, improved = moved, key(moved), True
    return [bounds[k + 1] - bounds[k] for k in range(num_stages)]


@dataclass(frozen=True)
class PipelineLayout:
    pp: int
    schedule: str
    microbatches: int
    layers: tuple[tuple[int, ...], ...]
    """Transformer layer indices of each stage, in stage order."""

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        return tuple(range(pp_rank, self.num_stages, self.pp))

    @property
    def last_rank(self) -> int:
        return (self.num_stages - 1) % self.pp

    def modules_of(self, stage: int) -> set[str]:
        names = {f"layers.{i}" for i in self.layers[stage]}
        if stage == 0:
            names.add("tok_embeddings")
        if stage == self.num_stages - 1:
            names.update(("norm", "output"))
        return names


def build_layout(pp: int, schedule: str, microbatches: int, stages_per_rank_: int, layers_per_stage: Sequence[str], n_layers: int,
                 costs: Callable[[], tuple[list[float], float, float]] | None = None) -> PipelineLayout:
    """`costs`: (each layer's, the embedding's, the output's) training FLOPs per token, read for a `balanced` split."""
    per_rank = stages_per_rank(schedule, stages_per_rank_)
    if list(layers_per_stage) == [BALANCED]:
        assert costs is not None, "a balanced split needs the layers' costs"
        layer_costs, first, last = costs()
        counts = balanced_counts(layer_costs, first, last, pp, pp * per_rank)
    else:
        counts = [int(n) for n in layers_per_stage] if layers_per_stage else None
    layers = split_layers(n_layers, pp * per_rank, counts)
    return PipelineLayout(pp, schedule, microbatches or default_microbatches(pp, per_rank), layers)


def layout_of(p: Parallelism, n_layers: int, costs: Callable[[], tuple[list[float], float, float]] | None = None) -> PipelineLayout | None:
    """The layout the `--parallelism` flags ask for; None without pipelining. `costs`: the model's per-layer,
    embedding and output FLOPs (models.stage_costs), for a balanced split."""
    if p.pp == 1:
        return None
    return build_layout(p.pp, p.pp_schedule, p.pp_microbatches, p.pp_stages_per_rank, p.pp_layers_per_stage, n_layers, costs)


def _keep_only(model: nn.Module, names: set[str]) -> None:
    for key in list(model.layers.keys()):
        if f"layers.{key}" not in names:
            del model.layers[key]
    for name in EDGE_MODULES:
        if name not in names:
            setattr(model, name, None)


def prune_to_rank(model: nn.Module, layout: PipelineLayout, pp_rank: int) -> nn.Module:
    """Delete (in place) what no stage of this rank runs; FQNs of what stays are the whole model's."""
    _keep_only(model, set().union(*(layout.modules_of(s) for s in layout.stages_of(pp_rank))))
    return model


def stage_views(model: nn.Module, layout: PipelineLayout, pp_rank: int) -> list[nn.Module]:
    """One module per local stage sharing the rank's blocks, parameters and buffers: its forward runs
    that stage's blocks only (torchtitan's models pass the input through absent modules)."""
    views = []
    for stage in layout.stages_of(pp_rank):
        view = copy.copy(model)
        view._modules = dict(model._modules)
        names = layout.modules_of(stage)
        view._modules["layers"] = nn.ModuleDict({k: m for k, m in model.layers.items() if f"layers.{k}" in names})
        for name in EDGE_MODULES:
            if name not in names:
                view._modules[name] = None
        views.append(view)
    return views


def _schedule_class(name: str) -> type:
    from torch.distributed.pipelining import schedules

    return getattr(schedules, f"Schedule{name}")


@dataclass(frozen=True)
class StageIO:
    """What the schedule sends between stages: token ids into the first stage, [microbatch, seq, dim] activations
    between stages (with tensor parallelism the rank's sequence shard: the blocks' sequence-parallel input), logits
    out of the last."""

    microbatch: int
    seq_len: int
    dim: int
    vocab: int
    dtype: torch.dtype
    tp: int = 1

    def input(self, stage: int, device: torch.device | str = "meta") -> torch.Tensor:
        if stage == 0:
            return torch.zeros(self.microbatch, self.seq_len, dtype=torch.long, device=device)
        # requires_grad marks what carries a gradient back between stages (torch 2.13 reads it from these)
        return torch.zeros(self.microbatch, self.seq_len // self.tp, self.dim, dtype=self.dtype, device=device, requires_grad=True)

    def output(self, stage: int, num_stages: int) -> torch.Tensor:
        if stage < num_stages - 1:
            return self.input(stage + 1)
        return torch.zeros(self.microbatch, self.seq_len, self.vocab, dtype=self.dtype, device="meta", requires_grad=True)


def build_schedule(views: Sequence[nn.Module], layout: PipelineLayout, pp_mesh: DeviceMesh, device: torch.device,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], io: StageIO):
    """The schedule over this rank's stages, their inputs and outputs declared (no shape inference round trip)."""
    from torch.distributed.pipelining import PipelineStage

    pp_rank = pp_mesh.get_local_rank()
    stages = [
        PipelineStage(view, s, layout.num_stages, device, input_args=io.input(s), output_args=io.output(s, layout.num_stages),
                      group=pp_mesh.get_group(),
                      # a traced stage splits its own backward (capture/backward_split.py); eager ones leave it to autograd
                      dw_builder=getattr(view, "dw_builder", None) if layout.schedule in SPLIT_BACKWARD else None)
        for view, s in zip(views, layout.stages_of(pp_rank))
    ]
    cls = _schedule_class(layout.schedule)
    target = stages if layout.schedule in LOOPED else stages[0]
    return cls(target, n_microbatches=layout.microbatches, loss_fn=loss_fn, scale_grads=False)


class PipelineStep:
    """One pipeline step over a rank's batch (the Step protocol of capture/): the schedule runs every
    microbatch's forward and backward, gradients add into `param.grad`, and the loss (the sum of the
    scaled microbatch losses, known on the last stage's rank) is broadcast over the pp group."""

    def __init__(self, schedule, layout: PipelineLayout, pp_mesh: DeviceMesh, device: torch.device,
                 around: Callable[[], ContextManager[None]] = contextlib.nullcontext, first: Callable[[], None] | None = None):
        """`around`: entered for each step (StepGather's gather-once); `first`: run in it before the first step's
        schedule (the traced stages' compile)."""
        self.schedule = schedule
        self.around = around
        self.first = first
        self.layout = layout
        self.group = pp_mesh.get_group()
        self.pp_rank = pp_mesh.get_local_rank()
        self.device = device

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        has_last = self.pp_rank == self.layout.last_rank
        losses: list[torch.Tensor] = []
        with self.around():
            if self.first is not None:
                self.first()
                self.first = None
            if self.pp_rank == 0:
                self.schedule.step(inputs, target=labels, losses=losses, return_outputs=False)
            else:
                self.schedule.step(target=labels, losses=losses, return_outputs=False)
        loss = torch.zeros((), device=self.device)
        if has_last:
            # in microbatch order, as gradient accumulation adds them up
            for micro_loss in losses:
                loss += micro_loss.detach()
        dist.broadcast(loss, src=dist.get_global_rank(self.group, self.layout.last_rank), group=self.group)
        return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def pipeline_total_norm(grads_by_stage: dict[int, list[torch.Tensor]], pp_mesh: DeviceMesh, grad_mesh: DeviceMesh) -> torch.Tensor:
    """The total 2-norm over the gradients of every stage, computed as pp 1 computes it over the whole
    model (torch's get_total_norm: one norm per tensor, then the norm of their stack, reduced over the
    data-parallel ranks), so that it is bitwise the same: each rank's per-tensor norms (local values and
    placements) are gathered over the pp group and stacked in stage order. `grad_mesh`: the mesh the
    gradients live on, for a rank whose stages have none of them (a dense-only stage in an MoE model's
    expert norm)."""
    own = {stage: list(torch._foreach_norm(grads, 2.0)) if grads else [] for stage, grads in grads_by_stage.items()}
    template = next((n for norms in own.values() for n in norms), None)
    mine = {stage: [(_local(n).cpu(), tuple(n.placements) if isinstance(n, DTensor) else None) for n in norms]
            for stage, norms in own.items()}
    gathered: list[dict] = [None] * pp_mesh.size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine, group=pp_mesh.get_group())
    by_stage = {s: entries for part in gathered for s, entries in part.items()}
    mesh = template.device_mesh if isinstance(template, DTensor) else grad_mesh
    device = torch.device(mesh.device_type)
    norms = []
    for stage in sorted(by_stage):
        for value, placements in by_stage[stage]:
            value = value.to(device)
            if placements is not None:
                value = DTensor.from_local(value, mesh, placements, run_check=False)
            norms.append(value)
    if not norms:
        return torch.zeros((), device=device)
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    return total.full_tensor() if isinstance(total, DTensor) else total


def stage_grads(views: Sequence[nn.Module], layout: PipelineLayout, pp_rank: int, keep: Callable[[torch.Tensor], bool] = lambda g: True) -> dict[int, list[torch.Tensor]]:
    return {s: [p.grad for p in v.parameters() if p.grad is not None and keep(p.grad)] for s, v in zip(layout.stages_of(pp_rank), views)}
