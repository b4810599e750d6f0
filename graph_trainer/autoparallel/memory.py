"""Per-rank memory of a plan, beside the parameters, gradients and optimizer state the parameter
layouts decide:

- activations saved for backward: what autograd keeps when a unit's forward runs (`autograd_keeps`,
  found once per unit kind at trace time: the tensors its ops save, each counted once at the op
  whose output owns its storage), at that op's chosen layout's local size, once per unit call that
  keeps them. Activation checkpointing
  (`--activation_checkpoint.mode`, applied per transformer block `layers.<i>` as torchtitan does)
  keeps only a recomputed block's input, plus one block's activations while it is recomputed:
  `full` recomputes every block, `selective` N every N-th (blocks N-1, 2N-1, ... counted from 0);
  op-level `selective` (`op`) keeps the outputs of matmuls and attention (the ops with FLOPs) and
  recomputes the rest in every block, so a kept value of another op costs instead the FLOP outputs
  and block inputs it is recomputed from (`ActivationPolicy.keeps`); units outside the blocks always
  keep theirs. Recomputation
  costs one more forward of what it recomputes (planner.py). MoE dispatch buffers are the routed-experts op's own
  (moe.MoECost.saved_bytes).
- gathered parameters: one unit's parameters in compute layout while it runs and the next one's
  prefetched, i.e. twice the largest unit's parameters, split over the mesh dims that are not data
  parallel (an estimate: it assumes tensor parallelism splits a unit's weights when present).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from ..flops import node_flops
from ..parallel.mesh import DP_DIMS
from ..passes.bucket_plan import block_of

Kept = dict[str, dict[int, float]]
"""Node name -> {output position: bytes kept for backward per byte of that output}."""


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

    def keeps(self, gm: fx.GraphModule, kept: Kept, inputs: set[str], modules: Sequence[str]) -> Kept:
        """`kept` under this policy. Op-level selective AC keeps of a block the outputs of ops with
        FLOPs and the block's `inputs` (activation placeholders), and recomputes any other kept value
        from those, which it keeps instead."""
        if self.mode != "op" or any(block_of(m) is None for m in modules):
            return kept
        out: Kept = {}
        nodes = {n.name: n for n in gm.graph.nodes}
        stack = [(nodes[name], pos) for name, outs in kept.items() for pos in outs]
        walked: set[str] = set()
        while stack:
            node, pos = stack.pop()
            if node.name in inputs or node_flops(node):
                out.setdefault(node.name, {})[pos] = kept.get(node.name, {}).get(pos, 1.0)
            elif node.op != "placeholder" and node.name not in walked:
                walked.add(node.name)
                for a in node.all_input_nodes:
                    if a.target is operator.getitem:
                        stack.append((a.args[0], a.args[1]))
                    elif isinstance(a.meta.get("val"), torch.Tensor):
                        stack.append((a, 0))
        return out

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


def autograd_keeps(gm: fx.GraphModule, n_params: int, n_buffers: int, differentiable: Sequence[bool], node_module: dict[str, str],
                   fused_attention: set[str]) -> Kept:
    """What autograd keeps for backward when `gm` (a unit's forward) runs on fake tensors, its
    placeholders being its parameters, its buffers and its inputs, of which those `differentiable`
    says (other units' outputs) require grad like the parameters: each saved tensor
    is charged once, to the op whose output owns its storage (a view's base; in-place results share
    their input's); saved parameters, buffers and other inputs (token ids, masks: resident anyway)
    are charged nothing.

    A trace on a device without the fused attention kernel the model's SDPA modules (`fused_attention`,
    their FQNs) would run, e.g. MLA's unequal head dims on a CPU, holds the math decomposition, which
    keeps the scores; such a region is charged what the fused kernel keeps instead: its query, key and
    value, its output, and a float32 logsumexp per output row (charged to the output)."""
    owner: dict[StorageWeakRef, tuple[fx.Node, int]] = {}
    value_of: dict[fx.Node, Any] = {}
    saved: list[torch.Tensor] = []

    class _Run(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            value_of[n] = out
            for i, t in enumerate(out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    owner.setdefault(StorageWeakRef(t.untyped_storage()), (n, i))
            return out

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_state = n_params + n_buffers
    with mode:
        args = [torch.empty_strided(p.meta["val"].shape, p.meta["val"].stride(), dtype=p.meta["val"].dtype, device=p.meta["val"].device,
                                    requires_grad=g and p.meta["val"].is_floating_point())
                for p, g in zip(placeholders, [True] * n_params + [False] * n_buffers + list(differentiable))]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _Run(gm).run(*args)
    frozen = set(placeholders[:n_state]) | {p for p, g in zip(placeholders[n_state:], differentiable) if not g}
    kept: Kept = {}

    def charge(t: torch.Tensor, factor: float = 1.0) -> None:
        node, pos = owner[StorageWeakRef(t.untyped_storage())]
        if node not in frozen:
            kept.setdefault(node.name, {})[pos] = max(factor, kept.get(node.name, {}).get(pos, 0.0))

    for t in saved:
        charge(t)
    for fqn in fused_attention:
        region = [n for n in gm.graph.nodes if n.op == "call_function" and node_module.get(n.name) == fqn]
        if not any(n.target is torch.ops.aten._safe_softmax.default for n in region):
            continue
        inside = set(region)
        for n in region:
            kept.pop(n.name, None)
        for n in region:
            for a in n.all_input_nodes:
                if a not in inside and isinstance(value_of.get(a), torch.Tensor):
                    charge(value_of[a])
            if any(u not in inside for u in n.users):
                out = value_of[n]
                charge(out, 1.0 + 4.0 / (out.shape[-1] * out.element_size()))
    return kept
