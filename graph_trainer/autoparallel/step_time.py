"""The step a plan predicts once its parameter collectives overlap compute, on the same timeline
simulation as the collective scheduling passes (`passes.cost_model.simulate`).

Positions: the unit calls in forward order, then their backwards in reverse, then the optimizer.
A unit call's forward is a third of its compute (matmuls: one forward GEMM, two backward) and its
backward the rest; redistributions of activations (tensor parallelism, the MoE all-to-alls) block
compute where they happen, so they are added to the position's time. Parameter collectives overlap
as the scheduling passes place them: a unit's all-gathers are issued one unit ahead (prefetch) and
waited for where the unit starts; its gradient reductions are issued when its backward ends and
waited for before the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..passes.cost_model import Timeline, Transfer, prefix_times, simulate


@dataclass
class UnitTimes:
    """Per call of one unit kind, in seconds."""

    compute: float = 0.0
    serial_forward: float = 0.0
    serial_backward: float = 0.0
    param_forward: float = 0.0
    """The unit's parameter gathers, one bucket (the solver prices one latency per unit)."""
    param_backward: float = 0.0
    """Its gradient reductions, one bucket."""


def overlapped_step(calls: Sequence[int], per_kind: dict[int, UnitTimes], optimizer_s: float, launch_s: float) -> Timeline:
    """`calls`: the unit kind of each call in forward order."""
    n = len(calls)
    times: list[float] = []
    for k in calls:
        u = per_kind[k]
        times.append(u.compute / 3 + u.serial_forward)
    for k in reversed(calls):
        u = per_kind[k]
        times.append(2 * u.compute / 3 + u.serial_backward)
    times.append(optimizer_s)
    transfers = []
    for i, k in enumerate(calls):
        u = per_kind[k]
        if u.param_forward:
            transfers.append(Transfer(max(i - 1, 0), i, u.param_forward, launch_s))
        if u.param_backward:
            transfers.append(Transfer(2 * n - i, 2 * n, u.param_backward, launch_s))
    return simulate(prefix_times(times), transfers)
