"""Per-rank memory of a plan, beside the parameters, gradients and optimizer state the parameter
layouts decide:

- activations saved for backward: every op of a unit whose output autograd may keep (not views),
  at its chosen layout's local size, once per unit call that keeps them. Activation checkpointing
  (`--activation_checkpoint.mode`, applied per transformer block `layers.<i>` as torchtitan does)
  keeps only a recomputed block's input, plus one block's activations while it is recomputed:
  `full` recomputes every block, `selective` N every N-th (blocks N-1, 2N-1, ... counted from 0);
  op-level `selective` (`op`) keeps the outputs of matmuls and attention (the ops with FLOPs) and
  recomputes the rest in every block; units outside the blocks always keep theirs. Recomputation
  costs one more forward of what it recomputes (planner.py). MoE dispatch buffers are the routed-experts op's own
  (moe.MoECost.saved_bytes).
- gathered parameters: one unit's parameters in compute layout while it runs and the next one's
  prefetched, i.e. twice the largest unit's parameters, split over the mesh dims that are not data
  parallel (an estimate: it assumes tensor parallelism splits a unit's weights when present).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..parallel.mesh import DP_DIMS
from ..passes.block_bucketing import block_of


@dataclass(frozen=True)
class ActivationPolicy:
    mode: str = "none"
    """none | full | selective (every N-th block) | op (op-level selective)"""
    every: int = 1
    """selective: every N-th block recomputes."""

    @classmethod
    def of(cls, mode: str, option: str) -> "ActivationPolicy":
        """From `--activation_checkpoint.mode` and `.selective_ac_option`; a mode this model does not
        know keeps everything (the safe side of a memory check)."""
        if mode == "selective":
            return cls("op") if option == "op" else cls("selective", int(option))
        return cls(mode if mode == "full" else "none")

    def recomputes_op(self, modules: Sequence[str], has_flops: bool) -> bool:
        """Op-level selective AC recomputes an op without FLOPs instead of keeping its output."""
        return self.mode == "op" and not has_flops and all(block_of(m) is not None for m in modules)

    def recomputed(self, modules: Sequence[str]) -> int:
        """How many of a unit's instances recompute all their activations in backward."""
        blocks = [block_of(m) for m in modules]
        if self.mode in ("none", "op") or any(b is None for b in blocks):
            return 0
        if self.mode == "full":
            return len(blocks)
        return sum(1 for b in blocks if (b + 1) % self.every == 0)

    def saved_copies(self, modules: Sequence[str]) -> tuple[int, int]:
        """(copies of each activation alive at the start of backward, copies of the unit's inputs
        kept for recomputation)."""
        r = self.recomputed(modules)
        return len(modules) - r + (1 if r else 0), r


def gathered_params_bytes(unit_param_bytes: Sequence[float], names: Sequence[str], shape: Sequence[int]) -> float:
    """Bytes of gathered parameters alive at once (see the module's docstring); 0 without data parallelism."""
    if all(s == 1 for n, s in zip(names, shape) if n in DP_DIMS) or not unit_param_bytes:
        return 0.0
    split = 1
    for n, s in zip(names, shape):
        if n not in DP_DIMS:
            split *= s
    return 2 * max(unit_param_bytes) / split
