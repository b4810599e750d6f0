"""DeepSeek V3 MoE placement: experts on the `ep` mesh, TP for attention/dense MLP/shared experts,
and torchtitan's MoE forward replaced by the static-shape dispatch of `moe_dispatch`.

Layouts (all decided on the meta-device model, before SimpleFSDP and materialisation):
- ep > 1: expert weights are DTensors Shard(0) (over experts) on the 1-D `ep` mesh; SimpleFSDP then
  stores them on the sparse mesh, sharded for `efsdp` on dim 1. Each rank routes its own tokens
  (with tp > 1: its sequence shard) and exchanges fixed-size buffers with its ep peers.
- ep == 1, tp > 1: expert weights are split on their hidden dim over `tp` (like the dense MLP); every
  tp rank routes all tokens and the experts' output is a partial sum.
- the router gate and shared experts stay replicated / Megatron-split on `tp`.

Gradient bookkeeping: inside a MoE block every locally computed contribution is a partial sum over
`tp` (declared with `Partial` grad placements). Expert weights under EP receive, through the
all-to-all, the gradient of every peer's local loss; SimpleFSDP then averages over the
`world / ep` copies of each expert. Each peer's loss is a mean over its own data-parallel share
(the same share for all tp ranks of a dp rank), so the sum over peers is `ep / tp` times too large
relative to the global-mean loss: the expert weights scale their gradient by `tp / ep`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.fx.traceback import annotate
from torchtitan.models.moe import MoE

from .compat import in_backward
from .mesh import DP_DIMS, Meshes
from .moe_dispatch import DispatchPlan, dispatch_and_combine, route


CHUNK_KEY = "moe_chunk"
"""`node.meta["custom"]` key: the token chunk of a split MoE layer (MoEPlan.chunks > 1) an op ran for."""


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by a constant in backward."""

    @staticmethod
    def forward(ctx, t: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


@dataclass(frozen=True)
class MoEPlan:
    dispatch: DispatchPlan
    tp_mesh: DeviceMesh | None
    experts_tp: bool
    """Experts split on their hidden dim over tp (ep == 1): every tp rank routes all tokens."""
    expert_grad_scale: float
    count_dims: tuple[str, ...]
    """Dense-mesh dims over which routed-token counts are summed to cover the global batch once."""
    chunks: int = 1
    """Token chunks routed and dispatched one after another (the `ep_overlap` pass interleaves one
    chunk's all-to-alls with another's compute); each chunk has its share of the capacity."""


def _compute_tensor(t: Tensor | None, partial_over_tp: bool) -> Tensor | None:
    if not isinstance(t, DTensor):
        return t
    return t.to_local(grad_placements=(Partial(),)) if partial_over_tp else t.to_local()


class StaticDispatchMoE(MoE):
    """torchtitan's MoE (same parameters, buffers and FQNs) with a routing-independent dispatch.

    Adds the non-persistent buffer `tokens_dropped` next to torchtitan's `tokens_per_expert` (which
    counts only the pairs the experts processed); the optimizer's pre-step hook (`LoadBalancing`)
    reads and clears both.
    """

    _moe_plan: MoEPlan

    def forward(self, x: Tensor) -> Tensor:
        plan = self._moe_plan
        tp = plan.tp_mesh
        needs_full = tp is not None and (plan.experts_tp or self.shared_experts is not None)
        x_full = x.redistribute(tp, (Replicate(),)) if needs_full else None
        if tp is None:
            tokens_in = x
        elif plan.experts_tp:
            tokens_in = x_full.to_local(grad_placements=(Partial(),))
        else:
            tokens_in = x.to_local()
        bs, slen, dim = tokens_in.shape
        tokens = tokens_in.reshape(-1, dim)

        gate = self.router.gate
        gate_weight, gate_bias = _compute_tensor(gate.weight, True), _compute_tensor(gate.bias, True)
        weights: list[Tensor] = []
        # Tokens are batch-major: halves split the batch, or each sequence when the batch is one.
        outputs = []
        # chunk(1) would still trace a split: the unsplit graph stays as it was
        for chunk, part in enumerate(tokens.chunk(plan.chunks) if plan.chunks > 1 else (tokens,)):
            with annotate({CHUNK_KEY: chunk}) if plan.chunks > 1 else contextlib.nullcontext():
                scores, experts = route(self.router, part, gate_weight, gate_bias, self.expert_bias)
                # read after the first routing, where the unsplit layer has always gathered them
                weights = weights or self._expert_weights()
                result = dispatch_and_combine(plan.dispatch, part, scores, experts, *weights)
            if not _is_recomputation():
                with torch.no_grad():
                    self.tokens_per_expert.add_(result.tokens_per_expert)
                    self.tokens_dropped.add_(result.dropped)
            outputs.append(result.output)
        routed = (torch.cat(outputs) if len(outputs) > 1 else outputs[0]).view(bs, slen, dim)

        if tp is None:
            return routed if self.shared_experts is None else self.shared_experts(x) + routed
        if plan.experts_tp:
            out = DTensor.from_local(routed, tp, (Partial(),), run_check=False)
            if self.shared_experts is not None:
                out = self.shared_experts(x_full) + out
            return out.redistribute(tp, (Shard(1),)).to_local()
        if self.shared_experts is None:
            return routed
        return self.shared_experts(x_full).redistribute(tp, (Shard(1),)).to_local() + routed

    def _expert_weights(self) -> list[Tensor]:
        weights = [_compute_tensor(w, False) for w in (self.experts.w1, self.experts.w2, self.experts.w3)]
        scale = self._moe_plan.expert_grad_scale
        return [_ScaleGrad.apply(w, scale) for w in weights] if scale != 1.0 else weights


def _moe_blocks(model: nn.Module) -> list[tuple[nn.Module, MoE]]:
    return [(block, block.moe) for block in model.layers.values() if block.moe_enabled]


def _replace_param(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    param = module._parameters[name]
    module._parameters[name] = nn.Parameter(distribute_tensor(param, mesh, [placement], src_data_rank=None), param.requires_grad)


def replicate_router_gates(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Every MoE block's router gate replicated on `tp` (for any MoE model's TP plan): each tp rank
    routes with the whole gate, and the MoE forward declares its gradient a partial sum over `tp`."""
    for _, moe in _moe_blocks(model):
        for name in ("weight", "bias"):
            if moe.router.gate._parameters.get(name) is not None:
                _replace_param(moe.router.gate, name, tp_mesh, Replicate())


def apply_moe_model_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """torchtitan's DeepSeek V3 TP plan for attention and dense layers, plus the MoE parts that do
    not depend on the ep degree: a replicated router gate and Megatron-split shared experts whose
    output stays a partial sum (the MoE forward reduce-scatters it with the routed output)."""
    from torchtitan.models.deepseek_v3.infra.parallelize import apply_non_moe_tp

    apply_non_moe_tp(model, tp_mesh, loss_parallel=False, enable_float8_tensorwise_tp=False, cp_enabled=False)
    replicate_router_gates(model, tp_mesh)
    for _, moe in _moe_blocks(model):
        if moe.shared_experts is not None:
            parallelize_module(
                moe.shared_experts,
                tp_mesh,
                {
                    "w1": ColwiseParallel(),
                    "w2": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
                    "w3": ColwiseParallel(),
                },
            )


def prepare_moe(model: nn.Module, meshes: Meshes, capacity_factor: float = 0.0, chunks: int = 1) -> None:
    """Place the routed experts (ep mesh, or tp-split when ep == 1) and install the static dispatch
    on every MoE module of a meta-device model; `chunks` > 1 splits each MoE's tokens (MoEPlan.chunks)."""
    deg = meshes.degrees
    tp_mesh = meshes.tp if deg.tp > 1 else None
    ep_mesh = meshes.ep if deg.ep > 1 else None
    experts_tp = ep_mesh is None and tp_mesh is not None
    count_dims = DP_DIMS if experts_tp or tp_mesh is None else (*DP_DIMS, "tp")
    for _, moe in _moe_blocks(model):
        experts = moe.experts
        if ep_mesh is not None:
            for name in ("w1", "w2", "w3"):
                _replace_param(experts, name, ep_mesh, Shard(0))
        elif experts_tp:
            for name, dim in (("w1", 1), ("w2", 2), ("w3", 1)):
                _replace_param(experts, name, tp_mesh, Shard(dim))
        dispatch = DispatchPlan(
            num_experts=experts.num_experts,
            top_k=moe.router.top_k,
            ep_mesh=ep_mesh,
            capacity_factor=capacity_factor,
            score_before_experts=moe.score_before_experts,
        )
        scale = deg.tp / deg.ep if ep_mesh is not None else 1.0
        moe.register_buffer("tokens_dropped", torch.zeros((), device="meta"), persistent=False)
        moe._moe_plan = MoEPlan(dispatch, tp_mesh, experts_tp, scale, count_dims, chunks)
        moe.__class__ = StaticDispatchMoE


def _is_recomputation() -> bool:
    """Whether this forward is activation checkpointing re-running a block for backward, whose routing
    was counted when the block first ran. Python recomputes inside backward (an autograd graph task
    runs): eager checkpointing and the make_fx traces of aot_fx_trace and aot alike. Dynamo's graphs
    recompute in their compiled backward without running this code, so its trace counts once."""
    return not torch.compiler.is_compiling() and in_backward()


@torch.no_grad()
def _update_expert_bias(moes: list[StaticDispatchMoE], meshes: Meshes) -> Tensor:
    """Auxiliary-loss-free load balancing (torchtitan's rule) on the counts of the global batch, which
    leave out dropped pairs. Returns the pairs dropped over the global batch, on the device."""
    stats = torch.stack([torch.cat([moe.tokens_per_expert, moe.tokens_dropped.view(1)]) for moe in moes])
    dense = meshes.dense
    for dim in moes[0]._moe_plan.count_dims:
        if dense.size(dense.mesh_dim_names.index(dim)) > 1:
            dist.all_reduce(stats, group=dense.get_group(dim))
    for moe, row in zip(moes, stats):
        if moe.load_balance_coeff is not None:
            counts = row[:-1]
            delta = moe.load_balance_coeff * torch.sign(counts.mean() - counts)
            moe.expert_bias.add_(delta - delta.mean())
        moe.tokens_per_expert.zero_()
        moe.tokens_dropped.zero_()
    return stats[:, -1].double().sum()


class LoadBalancing:
    """Before every optimizer step, sum the MoE token counts over the global batch, update each
    MoE's `expert_bias` from them and clear the counters (all in place: a traced train step holds
    these buffers as graph inputs and adds into the very same tensors).

    `dropped` is the step's dropped (token, expert) pairs over all ranks, left on the device: the
    trainer reads it in the one host sync of the step, with the loss and the gradient norm."""

    def __init__(self, optimizers: torch.optim.Optimizer, moes: list[StaticDispatchMoE], meshes: Meshes):
        self.moes, self.meshes = moes, meshes
        for moe in moes:
            moe.tokens_per_expert.zero_()
            moe.tokens_dropped.zero_()
        self.dropped = torch.zeros((), dtype=torch.float64, device=moes[0].tokens_per_expert.device)
        optimizers.register_step_pre_hook(self._before_step)

    def _before_step(self, *args, **kwargs) -> None:
        self.dropped = _update_expert_bias(self.moes, self.meshes)


def install_load_balancing(optimizers: torch.optim.Optimizer, model: nn.Module, meshes: Meshes) -> LoadBalancing | None:
    """Load balancing for a model's MoE blocks; None when it has none."""
    moes = [moe for _, moe in _moe_blocks(model) if isinstance(moe, StaticDispatchMoE)]
    return LoadBalancing(optimizers, moes, meshes) if moes else None
