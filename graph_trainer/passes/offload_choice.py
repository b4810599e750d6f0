"""Offload for the memory policy's budget (memory_policy.py): which activations to copy to host memory
and back (`choose_offloads`), and the transfers put into the rewritten graph (`offload_in_backward`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import fx

from ..hardware import Hardware
from .activations import Activations
from .cost_model import CostModel
from .liveness import Profile, Simulator, Step, graph_schedule
from .recompute import Ledger, schedule
from .transfers import insert_transfers, place, windows

OFFLOAD_LAUNCHES = 2
"""Kernel launches an offload adds (its two copies; the waits only order streams)."""
OFFLOAD_BACKENDS = ("none", "regional")
"""Backends that run the step graph's ops (outside compiled regions) in the graph's order."""


@dataclass(frozen=True)
class Offload:
    """What the budget policy may offload (`--activation_checkpoint.offload`) and the link it prices."""

    mode: str
    """never | auto | always"""
    hw: Hardware


NEVER = Offload("never", Hardware())


def loss_step(steps: list[Step], acts: Activations) -> int:
    """The index in `steps` of the last forward step: forward and backward meet there. (The loss itself
    may be gone: a loss only backward reads can be recomputed there.)"""
    boundary = -1
    for i, (key, node, _) in enumerate(steps):
        if key is node and acts.pos.get(node, len(acts.order)) <= acts.pos_of_loss:
            boundary = i
    return boundary


def choose_offloads(acts: Activations, ledger: Ledger, profile: Profile, budget_bytes: float, offload: Offload,
                    build: Callable, simulator: Simulator, node_time: Callable[[fx.Node], float]) -> set[fx.Node]:
    """The activations `plan_memory_budget` offloads (see there), before any recomputation."""
    if offload.mode == "never" or not acts.offloadable:
        return set()
    steps = schedule(acts, set())
    spans = windows(steps, loss_step(steps, acts))
    candidates = [r for r in acts.offloadable if r in spans and spans[r][0] + 1 < spans[r][1]]
    if offload.mode == "always":
        return set(candidates)
    if offload.hw.host_link_bytes_per_s <= 0:
        return set()

    def recompute_s(root: fx.Node) -> float:
        chain = ledger.closure([root], lambda n: False) if root in acts.recomputable else None
        return float("inf") if chain is None else sum(node_time(n) for n in chain)

    costs = {r: recompute_s(r) for r in candidates}
    # The copies' launches are host work like any kernel's: where recomputing costs less, recompute.
    dear = [r for r in candidates if costs[r] > OFFLOAD_LAUNCHES * offload.hw.launch_s]
    chosen: set[fx.Node] = set()
    left = sorted(dear, key=lambda r: (-costs[r] / max(acts.root_bytes(r), 1), acts.pos[r]))
    # The peak moves as activations leave it: sweep again over those not live at it before, until a
    # sweep adds nothing.
    progress = True
    while progress and profile.peak > budget_bytes:
        progress, skipped = False, []
        for root in left:
            if profile.peak <= budget_bytes or root not in profile.alive:
                skipped.append(root)
                continue
            trial = chosen | {root}
            trial_steps, plan = build(set(), trial)
            if any(t.exposed_s > 0 for t in plan.values()):
                continue
            lowered = simulator(trial_steps)
            if lowered.peak < profile.peak:
                chosen, profile, progress = trial, lowered, True
        left = skipped
    return chosen


def offload_in_backward(gm: fx.GraphModule, acts: Activations, roots: set[fx.Node], cost: CostModel) -> fx.GraphModule:
    """Put the transfers of `roots` into the graph (already rewritten for recomputation): placed on
    the graph's own order, which is the schedule the policy simulated, so they land where it put them."""
    steps = graph_schedule(gm.graph.nodes)
    plan = place(steps, roots, loss_step(steps, acts), cost.node_time, cost.hw)
    return insert_transfers(gm, plan)
