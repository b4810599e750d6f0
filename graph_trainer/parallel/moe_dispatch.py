"""MoE routing and token dispatch whose tensor shapes never depend on the routing.

torchtitan's dispatch sizes its buffers and all-to-all splits from `.tolist()` of the per-expert
token counts, so a graph traced once bakes in one step's routing and breaks when routing changes.
Here every shape is a function of (tokens, top_k, experts, ep, capacity) alone:

1. the T*top_k (token, expert) pairs are sorted (permutations of static size);
2. each peer (with expert parallelism: each rank of the ep mesh) gets a fixed buffer of `capacity`
   rows; when its pairs do not fit, it keeps those of highest routing score and drops the rest
   (their expert output is zero; they are counted, and left out of the per-expert counts). The kept
   pairs sit in the buffer in expert order. Buffers and per-expert counts travel by
   `all_to_all_single` with equal splits;
3. the receiver regroups rows by local expert and runs the experts with grouped GEMMs whose group
   boundaries are an offsets tensor (data, not shapes); rows past the last offset are padding;
4. outputs travel back the same way and each pair gathers its row from its slot.

Padding rows never mix arithmetically with real ones: `torch.where` masks them on both ends, in
forward and backward, so uninitialised rows of a grouped GEMM cannot leak into results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .compat import is_fake_process_group

# Private torch APIs this module relies on; both exist in torch 2.11 through 2.13.
try:
    from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
except ImportError as e:  # pragma: no cover  (only on an unsupported torch)
    raise ImportError("graph_trainer's MoE dispatch needs torch's functional all_to_all_single (torch >= 2.11)") from e
if not hasattr(torch, "_grouped_mm"):  # pragma: no cover
    raise ImportError("graph_trainer's MoE dispatch needs torch._grouped_mm (torch >= 2.11)")


@torch.library.custom_op("graph_trainer::grouped_mm", mutates_args=())
def _grouped_mm_any_dtype(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """`torch._grouped_mm` for dtypes its fake-tensor rule rejects (it admits bfloat16 only, so
    make_fx cannot trace an fp32 grouped GEMM); as a custom op it is one opaque graph node."""
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_any_dtype.register_fake
def _(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


def _grouped_mm_backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    a, b, offs = ctx.saved_tensors
    grad_a = _grouped_mm_any_dtype(grad, b.transpose(-2, -1), offs)
    grad_b = _grouped_mm_any_dtype(a.transpose(0, 1), grad, offs)
    return grad_a, grad_b, None


def _grouped_mm_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


_grouped_mm_any_dtype.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """(rows, k) x (groups, k, n) -> (rows, n); group g uses rows offs[g-1]:offs[g]."""
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    return _grouped_mm_any_dtype(a, b, offs)


class _SwiGLUDown(torch.autograd.Function):
    """w2(silu(a) * b) over grouped rows, keeping only a and b for backward: autograd would also keep
    silu(a) and the product, two more (rows, hidden) tensors per MoE layer (at DeepSeek V3 16B with
    8-way EP, 4 x 4096 tokens and capacity factor 2: 1.1 GB a layer). The backward recomputes both with
    the kernels autograd would have run forward, and applies the same backward formulas."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, w2t: Tensor, offsets: Tensor) -> Tensor:
        ctx.save_for_backward(a, b, w2t, offsets)
        return grouped_mm(F.silu(a) * b, w2t, offsets)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        a, b, w2t, offsets = ctx.saved_tensors
        silu_a = F.silu(a)
        grad_w2t = grouped_mm((silu_a * b).transpose(0, 1), grad, offsets)
        grad_h = grouped_mm(grad, w2t.transpose(-2, -1), offsets)
        return torch.ops.aten.silu_backward(grad_h * b, a), grad_h * silu_a, grad_w2t, None


def swiglu_experts(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, offsets: Tensor) -> Tensor:
    """The experts' FFN, w2(silu(w1 x) * w3 x), over rows grouped by expert."""
    a = grouped_mm(x, w1.transpose(-2, -1), offsets)
    b = grouped_mm(x, w3.transpose(-2, -1), offsets)
    return _SwiGLUDown.apply(a, b, w2.transpose(-2, -1), offsets)


class _WeightedSum(torch.autograd.Function):
    """sum_k scores[t, k] * rows[t, k] in fp32, keeping the rows in their own dtype for backward (autograd would
    keep the fp32 copy: 0.8 GB a layer at 16B, 4 x 4096 tokens); upcasting again in backward gives the same values.
    A product and a sum over k rather than torchtitan's bmm of a (1 x k) by a (k x dim) matrix per token: cuBLAS
    runs such fp32 batched products on CUDA cores with tiles mostly empty (DeepSeek V3 16B's step on an H200 spent
    48 ms in one fp32 GEMM a MoE layer), where Inductor fuses a multiply-reduce with the kernels around it."""

    @staticmethod
    def forward(ctx, scores: Tensor, rows: Tensor) -> Tensor:
        ctx.save_for_backward(scores, rows)
        return (scores.unsqueeze(-1) * rows.float()).sum(dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        scores, rows = ctx.saved_tensors
        grad_scores = (grad.unsqueeze(1) * rows.float()).sum(dim=-1) if ctx.needs_input_grad[0] else None
        grad_rows = (scores.unsqueeze(-1) * grad.unsqueeze(1)).to(rows.dtype) if ctx.needs_input_grad[1] else None
        return grad_scores, grad_rows


class _PermuteRows(torch.autograd.Function):
    """`t` with its rows in the order `perm` (a permutation), whose gradient is gathered back by the inverse
    permutation. Autograd's backward of a gather is a scatter-add, one atomic add per element though no two
    rows meet: at DeepSeek V3 16B, 8-way EP on an H200, that index_add took 90 ms of a 983 ms step."""

    @staticmethod
    def forward(ctx, t: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return t.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


@dataclass(frozen=True)
class DispatchPlan:
    num_experts: int
    top_k: int
    ep_mesh: DeviceMesh | None
    """The 1-D expert-parallel mesh; None when every rank holds all experts."""
    capacity_factor: float
    """Rows per peer buffer as a multiple of the even share T*top_k/ep; 0: T*top_k (never drops)."""
    score_before_experts: bool

    @property
    def ep(self) -> int:
        return 1 if self.ep_mesh is None else self.ep_mesh.size()

    def capacity(self, num_tokens: int) -> int:
        return buffer_rows(num_tokens * self.top_k, self.ep, self.capacity_factor)


def buffer_rows(pairs: int, ep: int, capacity_factor: float) -> int:
    """Rows of each peer's dispatch buffer for `pairs` local (token, expert) pairs."""
    if capacity_factor <= 0:
        return pairs
    return max(1, min(pairs, math.ceil(capacity_factor * pairs / ep)))


@dataclass
class DispatchResult:
    output: Tensor
    """(tokens, dim): the routed experts' output, weighted by the routing scores."""
    tokens_per_expert: Tensor
    """(experts,) float: pairs each expert processed (dropped pairs are not counted)."""
    dropped: Tensor
    """() float: pairs that found no room in their peer's buffer."""


def _exchange(t: Tensor, mesh: DeviceMesh) -> Tensor:
    """Equal-split all-to-all along dim 0: chunk r goes to peer r, chunk r of the result came from it."""
    if t.requires_grad:
        return all_to_all_single_autograd(t, None, None, mesh)
    return all_to_all_single(t, None, None, mesh)


def _bounded_counts(counts: Tensor, capacity: int) -> Tensor:
    """Counts a real peer could have sent (>= 0, at most `capacity` rows per peer). The fake process
    group's all-to-all returns uninitialised memory; indexing with it would leave the buffers."""
    ends = torch.cumsum(counts.clamp(0, capacity), dim=1).clamp(max=capacity)
    return torch.diff(ends, dim=1, prepend=torch.zeros_like(ends[:, :1]))


def _group_by_expert(recv: Tensor, recv_counts: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """Rows arrive as [peer 0: expert 0 rows, expert 1 rows, ..., padding][peer 1: ...]; the experts
    need [expert 0: rows of peer 0, peer 1, ...][expert 1: ...][padding]. Returns, for every received
    row, its position in that order (a permutation of the rows), and the rows per local expert."""
    ep, local_experts = recv_counts.shape
    device = recv.device
    ends = torch.cumsum(recv_counts, dim=1)
    starts = ends - recv_counts
    row = torch.arange(capacity, device=device).expand(ep, capacity).contiguous()
    expert = torch.searchsorted(ends, row, right=True)
    valid = expert < local_experts
    expert = expert.clamp(max=local_experts - 1)
    per_expert = recv_counts.sum(dim=0)
    expert_start = torch.cumsum(per_expert, dim=0) - per_expert
    from_earlier_peers = torch.cumsum(recv_counts, dim=0) - recv_counts
    peer = torch.arange(ep, device=device).unsqueeze(1)
    dest = expert_start[expert] + from_earlier_peers[peer, expert] + row - starts[peer, expert]
    padding_rank = torch.cumsum((~valid).flatten().long(), dim=0) - 1
    dest = torch.where(valid.flatten(), dest.flatten(), per_expert.sum() + padding_rank)
    return dest, per_expert


def dispatch_and_combine(
    plan: DispatchPlan, x: Tensor, scores: Tensor, experts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor
) -> DispatchResult:
    """x: (tokens, dim); scores, experts: (tokens, top_k) routing weights and global expert ids;
    w1/w2/w3: this rank's experts (num_experts / ep of them)."""
    num_tokens, dim = x.shape
    top_k, ep = plan.top_k, plan.ep
    local_experts = plan.num_experts // ep
    pairs = num_tokens * top_k
    capacity = plan.capacity(num_tokens)
    device = x.device

    flat_expert = experts.reshape(-1)
    flat_peer = flat_expert // local_experts
    peer_pairs = torch.zeros(ep, dtype=torch.int64, device=device).scatter_add_(0, flat_peer, torch.ones_like(flat_peer))
    peer_start = torch.cumsum(peer_pairs, dim=0) - peer_pairs
    # A full buffer keeps its peer's `capacity` pairs of highest routing score, whichever experts they
    # go to: the dropped pairs are the ones that would have weighed least in their tokens' outputs.
    # Equal scores keep the earlier (token, k) pair.
    by_score = torch.argsort(scores.detach().reshape(-1), descending=True, stable=True)
    by_peer = by_score[torch.argsort(flat_peer[by_score], stable=True)]
    rank_by_score = torch.arange(pairs, device=device) - peer_start[flat_peer[by_peer]]
    pair_kept = torch.zeros(pairs, dtype=torch.bool, device=device).scatter(0, by_peer, rank_by_score < capacity)
    # The buffer holds the kept pairs in expert order (each expert's rows together for the grouped
    # GEMMs), then padding: sort each peer's pairs by (dropped, local expert), stable in pair order.
    order = torch.argsort(
        (flat_peer * 2 + (~pair_kept).long()) * local_experts + flat_expert % local_experts, stable=True
    )
    counts = torch.zeros(plan.num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat_expert, pair_kept.long())
    kept = counts.view(ep, local_experts)

    slot_row = torch.arange(capacity, device=device)
    slot_valid = (slot_row.unsqueeze(0) < kept.sum(dim=1, keepdim=True)).flatten()
    slot_pair = order[(peer_start.unsqueeze(1) + slot_row.unsqueeze(0)).flatten().clamp(max=pairs - 1)]
    rows = x[slot_pair // top_k]
    if plan.score_before_experts:
        rows = (rows.float() * scores.reshape(-1)[slot_pair].unsqueeze(1)).to(x.dtype)
    send = torch.where(slot_valid.unsqueeze(1), rows, rows.new_zeros(()))

    if plan.ep_mesh is None:
        grouped, group_sizes = send, kept[0]
    else:
        recv = _exchange(send, plan.ep_mesh)
        recv_counts = _exchange(kept.flatten(), plan.ep_mesh).view(ep, local_experts)
        if is_fake_process_group():
            recv_counts = _bounded_counts(recv_counts, capacity)
        dest, group_sizes = _group_by_expert(recv, recv_counts, capacity)
        source = torch.empty_like(dest).scatter_(0, dest, torch.arange(dest.numel(), device=device))
        grouped = _PermuteRows.apply(recv, source, dest)
    offsets = torch.cumsum(group_sizes, dim=0, dtype=torch.int32)
    out = swiglu_experts(grouped, w1, w2, w3, offsets)
    if plan.ep_mesh is not None:
        out = _exchange(_PermuteRows.apply(out, dest, source), plan.ep_mesh)

    # Each kept pair's slot: its place among its peer's kept pairs (in expert order) after that peer's offset.
    sorted_peer = flat_peer[order]
    rank_in_peer = torch.arange(pairs, device=device) - peer_start[sorted_peer]
    pair_slot = torch.zeros_like(order).scatter(0, order, sorted_peer * capacity + rank_in_peer.clamp(max=capacity - 1))
    pair_out = torch.where(pair_kept.unsqueeze(1), out[pair_slot], out.new_zeros(())).view(num_tokens, top_k, dim)
    if plan.score_before_experts:
        routed = pair_out.sum(dim=1)
    else:
        routed = _WeightedSum.apply(scores, pair_out).to(x.dtype)
    dropped = (pairs - pair_kept.sum()).float()
    return DispatchResult(routed, counts.float(), dropped)


def route(router: torch.nn.Module, x: Tensor, gate_weight: Tensor, gate_bias: Tensor | None, expert_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """torchtitan's token-choice top-k routing (same math, same order of operations) without its
    `histc` count, which has no CPU kernel for integer input. Returns (scores, experts), each
    (tokens, top_k)."""
    logits = F.linear(x, gate_weight, gate_bias)
    if router.score_func == "sigmoid":
        scores = torch.sigmoid(logits.to(torch.float32))
    else:
        scores = F.softmax(logits.to(torch.float32), dim=1)
    choice = scores if expert_bias is None else scores + expert_bias
    if router.num_expert_groups is not None:
        choice = router._get_node_limited_routing_scores(choice)
    _, experts = torch.topk(choice, k=router.top_k, dim=-1, sorted=False)
    top_scores = scores.gather(dim=1, index=experts)
    if router._debug_force_load_balance:
        experts, top_scores = router._debug_force_load_balance_routing(scores)
    if router.route_norm:
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
    return top_scores * router.route_scale, experts
