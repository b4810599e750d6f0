"""DeepSeek V3's mixture of experts for the solver: the routed experts are one op with declared strategies.

Routing is data dependent: which expert a token visits, and so how many rows each expert's GEMM
gets, is only known at run time. The manual plan makes the step traceable anyway with the
static-shape dispatch of `parallel/moe_dispatch.py` (fixed-capacity buffers, equal-split all-to-alls,
grouped GEMMs with an offsets tensor). Its dozens of index ops (argsort, scatter, searchsorted, ...)
have no DTensor strategy and no meaningful per-op sharding, so the solver does not see them. What a
MoE module traces to, for the solver:

- the router (gate linear, softmax/sigmoid, expert bias, top-k, gather) and the shared experts: plain
  aten ops placed by their DTensor strategies like every dense op;
- ONE op, `graph_trainer::routed_experts(tokens, scores, experts, w1, w2, w3)`: sort by expert,
  dispatch, the experts' SwiGLU as grouped GEMMs, combine. Its strategies are declared here, per
  solver mesh dimension, each one a way the manual plan (or torchtitan) runs MoE:

  | choice on a mesh dim | tokens, scores, ids | expert weights | output | communication inside the op |
  |---|---|---|---|---|
  | `replicate` | R | R | R | none (every rank does the same work) |
  | `tokens` (FSDP-like) | S(0) | R (gathered by the edge from storage) | S(0) | none |
  | `experts` (expert parallel, EP) | S(0) | S(0), experts split | S(0) | all-to-alls of the dispatch buffers |
  | `hidden` (Megatron-like) | R | w1, w3 S(1), w2 S(2) | P | none (the output is a partial sum) |

  At most one dim may be `experts` (EP over that dim, ep = its size, as `--parallelism.ep` does over
  dp_shard by hand). The storage of the expert weights is a separate choice, like any parameter's,
  so `tokens` with storage S(0) is FSDP of the experts (all-gather forward, reduce-scatter backward,
  priced on the edge), and `experts` with storage S(0) needs no parameter collective at all.

Costs: compute is the roofline of the three expert GEMMs over the routed rows (6 T K D H FLOPs for
T tokens, top-k K, dim D, expert hidden H) split over the dims that split the work, plus the bytes of
the local expert weights and routed rows; x3 for forward + backward; plus the per-kernel floor of
each of the dispatch's other kernels (`DISPATCH_KERNELS`). An EP dim of n ranks sends per
rank a buffer of n * C rows of D (C = the capacity of `moe_dispatch`, from
`--parallelism.moe_capacity_factor`; all pairs when 0): forward an all-to-all for the tokens, a small
one for the per-expert counts and one for the outputs; backward the two large ones again. The
alpha-beta model of costs.py prices them on that dim's links; the plan report lists them.

What the solver cannot choose: the capacity factor (a config setting: it trades dropped tokens for
buffer size), EP over two dims at once, EP of ranks whose tokens are replicated, sharding the routed
tokens on anything but their token dim (a sequence shard arrives gathered on that dim), and
placements inside the dispatch. The load-balancing counts stay per rank and are summed over the dims
that split the tokens before each optimizer step (`install_load_balancing`, as in the manual plan).

Applying a choice (apply.py): the op's inputs arrive as DTensors in the chosen layouts; the op runs
`dispatch_and_combine` on their local shards, with the EP dim's 1-D mesh as its expert-parallel mesh,
and returns a DTensor in the chosen output layout. Gradients are declared with the same rule as
everywhere in the solver (costs.grad_spec), so they come out as DTensor would derive them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..parallel.expert_parallel import MoEPlan, StaticDispatchMoE
from ..parallel.moe_dispatch import DispatchPlan, buffer_rows, dispatch_and_combine, route
from ..hardware import Hardware, roofline_s
from .costs import CommModel, grad_spec
from .plan_format import unit_pattern
from .strategies import Spec, Strategy, evenly_sharded
from .trace import ModelTrace, UnitGraph

CHOICES = ("replicate", "tokens", "experts", "hidden")
_SPECS = {  # per mesh dim: (tokens, scores, expert ids, w1, w2, w3) -> output
    "replicate": (("R", "R", "R", "R", "R", "R"), "R"),
    "tokens": (("S0", "S0", "S0", "R", "R", "R"), "S0"),
    "experts": (("S0", "S0", "S0", "S0", "S0", "S0"), "S0"),
    "hidden": (("R", "R", "R", "S1", "S2", "S1"), "P"),
}
_COUNT_BYTES = 8  # the per-expert counts travel as int64
DISPATCH_KERNELS = 85
"""Kernels of one routed-experts op, forward and backward, on one rank: the non-view aten ops of
`dispatch_and_combine` and its gradient, the recomputed SwiGLU product included (tests/test_solver_moe.py
traces and counts them). Routing
bookkeeping (sorts, scans, scatters, gathers over token x top-k pairs) is most of them: each costs
the per-kernel floor, not its bytes."""
DISPATCH_GEMMS = 9
"""Of those, the grouped GEMMs (three forward, six backward), priced by the roofline."""


@torch.library.custom_op("graph_trainer::routed_experts", mutates_args=())
def routed_experts(tokens: Tensor, scores: Tensor, experts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
                   score_before_experts: bool) -> Tensor:
    """What the op means: every (token, expert) pair through its expert's SwiGLU, weighted by its
    score and summed per token, on one process and dropping nothing. Placed runs go through
    `run_routed_experts` instead, which adds the chosen layout and capacity."""
    plan = DispatchPlan(w1.shape[0], scores.shape[1], None, 0.0, score_before_experts)
    return dispatch_and_combine(plan, tokens, scores, experts, w1, w2, w3).output


@routed_experts.register_fake
def _(tokens, scores, experts, w1, w2, w3, score_before_experts):
    return torch.empty_like(tokens)


ROUTED_EXPERTS = torch.ops.graph_trainer.routed_experts.default


class SolverMoE(StaticDispatchMoE):
    """torchtitan's MoE (same parameters, buffers and FQNs) as the solver traces it: the router's ops,
    the routed experts as one op, the shared experts. The same arithmetic as the manual plan's
    `StaticDispatchMoE` on one rank, in the same order."""

    def forward(self, x: Tensor) -> Tensor:
        bs, slen, dim = x.shape
        tokens = x.reshape(-1, dim)
        gate = self.router.gate
        scores, experts = route(self.router, tokens, gate.weight, gate.bias, self.expert_bias)
        e = self.experts
        routed = routed_experts(tokens, scores, experts, e.w1, e.w2, e.w3, self.score_before_experts).view(bs, slen, dim)
        return routed if self.shared_experts is None else self.shared_experts(x) + routed


def prepare_model(model: nn.Module) -> None:
    """Make every MoE of a meta-device model a `SolverMoE` (idempotent), with the `tokens_dropped`
    counter the load-balancing hook reads next to torchtitan's `tokens_per_expert`."""
    from torchtitan.models.moe import MoE

    for module in model.modules():
        if isinstance(module, MoE) and not isinstance(module, SolverMoE):
            module.register_buffer("tokens_dropped", torch.zeros((), device="meta"), persistent=False)
            module.__class__ = SolverMoE


def choice_names(strategy: Strategy) -> tuple[str, ...]:
    """The per-mesh-dim choice a strategy of the routed-experts op stands for."""
    by_specs = {v: k for k, v in _SPECS.items()}
    return tuple(by_specs[(tuple(spec[m] for spec in strategy.ins), strategy.outs[0][m])] for m in range(len(strategy.outs[0])))


def declared_strategies(node: fx.Node, sizes: Sequence[int], names: Sequence[str], pinned_ep_dim: str | None) -> list[Strategy]:
    """Every combination of per-dim choices whose shards divide evenly, with at most one EP dim
    (exactly `pinned_ep_dim` when `--parallelism.ep` pins it)."""
    vals = [a.meta["val"] for a in node.args[:6]]
    out_shape = node.meta["val"].shape
    found = []
    for combo in itertools.product(CHOICES, repeat=len(sizes)):
        ep_dims = [names[m] for m, c in enumerate(combo) if c == "experts"]
        if len(ep_dims) > 1 or (pinned_ep_dim is not None and ep_dims != [pinned_ep_dim]):
            continue
        ins = tuple(tuple(_SPECS[c][0][i] for c in combo) for i in range(6))
        out: Spec = tuple(_SPECS[c][1] for c in combo)
        if all(evenly_sharded(s, v.shape, sizes) for s, v in zip(ins, vals)) and evenly_sharded(out, out_shape, sizes):
            found.append(Strategy((out,), ins))
    return found


@dataclass(frozen=True)
class MoECost:
    compute_s: float
    collectives: tuple[tuple[str, str, float, float], ...]
    """(direction, kind, bytes, seconds) of the all-to-alls inside the op."""
    saved_bytes: float = 0.0
    """Kept for backward (what `dispatch_and_combine` saves): the rows the experts ran on (every peer's
    buffer, padding included), their two hidden projections, and each routed pair's output."""


def strategy_cost(node: fx.Node, strategy: Strategy, sizes: Sequence[int], comm: CommModel, hw: Hardware,
                  capacity_factor: float) -> MoECost:
    tokens, scores, _, w1, w2, w3 = (a.meta["val"] for a in node.args[:6])
    num_tokens, dim = tokens.shape
    top_k = scores.shape[1]
    num_experts, hidden = w1.shape[0], w1.shape[1]
    choices = choice_names(strategy)
    token_split = math.prod(n for n, c in zip(sizes, choices) if c in ("tokens", "experts"))
    hidden_split = math.prod(n for n, c in zip(sizes, choices) if c == "hidden")
    weight_split = math.prod(n for n, c in zip(sizes, choices) if c in ("experts", "hidden"))
    itemsize = tokens.element_size()
    local_pairs = num_tokens // token_split * top_k
    flops = 6.0 * local_pairs * dim * hidden / hidden_split
    weight_bytes = sum(w.numel() for w in (w1, w2, w3)) * w1.element_size() / weight_split
    row_bytes = local_pairs * (2 * dim + 3 * hidden / hidden_split) * itemsize
    gemms = 3.0 * roofline_s(flops, weight_bytes + row_bytes, tokens.dtype, hw)
    compute = max(gemms, DISPATCH_GEMMS * hw.launch_s) + (DISPATCH_KERNELS - DISPATCH_GEMMS) * hw.launch_s
    ep = next((n for n, c in zip(sizes, choices) if c == "experts"), 1)
    expert_rows = ep * buffer_rows(local_pairs, ep, capacity_factor)
    saved = (expert_rows * (dim + 2 * hidden / hidden_split) + local_pairs * dim) * itemsize
    collectives = []
    for m, c in enumerate(choices):
        if c != "experts":
            continue
        buffer = expert_rows * dim * itemsize
        counts = num_experts * _COUNT_BYTES
        for direction, kind, nbytes in (("forward", "dispatch", buffer), ("forward", "counts", counts), ("forward", "combine", buffer),
                                        ("backward", "dispatch", buffer), ("backward", "combine", buffer)):
            collectives.append((direction, "all_to_all", nbytes, comm.collective("all_to_all", nbytes, m)))
    return MoECost(compute, tuple(collectives), saved)


def module_path(node: fx.Node, unit: UnitGraph) -> str:
    """The path, inside its unit, of the MoE module a routed-experts node belongs to (w1's owner's owner)."""
    placeholders = [n.name for n in unit.gm.graph.nodes if n.op == "placeholder"]
    w1 = unit.param_names[placeholders.index(node.args[3].name)]
    return w1.rsplit(".", 2)[0]


def plan_summary(trace: ModelTrace, strategies: list[list[Strategy]], choice: list[int], unit_nodes: dict[int, dict[str, int]],
                 mesh: Any, capacity_factor: float) -> dict[str, Any]:
    """What a plan does with the routed experts of each kind of MoE block: per solver mesh dim the
    choice, the expert-parallel dim and degree, and how many alternatives the solver had."""
    out: dict[str, Any] = {}
    for unit in trace.units:
        for node in unit.gm.graph.nodes:
            if node.target is not ROUTED_EXPERTS:
                continue
            i = unit_nodes[unit.kind][node.name]
            choices = dict(zip(mesh.solver_names, choice_names(strategies[i][choice[i]])))
            ep_dims = [n for n, c in choices.items() if c == "experts"]
            out[f"{unit_pattern(unit)}.{module_path(node, unit)}"] = {
                "count": len(unit.modules), "choice": choices,
                "expert_parallel": {"dim": ep_dims[0], "degree": mesh.shape[mesh.names.index(ep_dims[0])]} if ep_dims else None,
                "capacity_factor": capacity_factor,
                "alternatives": len(strategies[i]),
            }
    return out


def ep_dim(spec_of_w1: Sequence[str], names: Sequence[str]) -> str | None:
    """The mesh dim the experts are split over (EP), from w1's layout in the plan."""
    return next((n for n, p in zip(names, spec_of_w1) if p == "S0"), None)


def install(moe: SolverMoE, mesh: DeviceMesh, solver_dims: Sequence[str], strategy: Strategy, capacity_factor: float) -> None:
    """Give a placed MoE the dispatch of its plan: the EP dim's 1-D mesh, and the dims over which
    its routed-token counts must be summed (those that split the tokens)."""
    dim = ep_dim(strategy.ins[3], solver_dims)
    dispatch = DispatchPlan(moe.experts.num_experts, moe.router.top_k, mesh[dim] if dim else None, capacity_factor,
                            moe.score_before_experts)
    count_dims = tuple(n for n, p in zip(solver_dims, strategy.ins[0]) if p.startswith("S"))
    moe._moe_plan = MoEPlan(dispatch, None, False, 1.0, count_dims)


def run_routed_experts(moe: SolverMoE, mesh: DeviceMesh, strategy: Strategy, args: Sequence[Any],
                       placements: Callable[[Spec], tuple]) -> DTensor:
    """The op on DTensors already in the strategy's input layouts; `placements` turns a solver spec
    into the mesh's placements. Local gradients are declared as the solver priced them."""
    local = []
    for i, a in enumerate(args[:6]):
        if a.dtype.is_floating_point:
            local.append(a.to_local(grad_placements=placements(grad_spec(strategy, i))))
        else:
            local.append(a.to_local())
    result = dispatch_and_combine(moe._moe_plan.dispatch, *local)
    with torch.no_grad():
        moe.tokens_per_expert.add_(result.tokens_per_expert)
        moe.tokens_dropped.add_(result.dropped)
    return DTensor.from_local(result.output, mesh, placements(strategy.outs[0]), run_check=False)
