"""The placement program, solved with HiGHS.

One binary x[n,s] per node strategy (exactly one per node). An edge from a producer output to a
consumer argument prices a redistribution that depends on the producer's output layout (group o)
and on the layout plus gradient layout the consumer asks for (group k). Instead of one variable per
strategy pair, an edge gets one variable y[e,o,k] per *layout* pair with marginal rows
    sum_k y[e,o,k] = sum_{s in o} x[p,s]     and     sum_o y[e,o,k] = sum_{s in k} x[c,s],
the local-polytope formulation whose LP relaxation is integral in practice (AutoParallel's finding;
see NOTES.md). An edge whose one side has a single layout folds its cost into the other side's x.
Layout pairs that cannot be redistributed (to Partial) get no variable, so they cannot be chosen.
The memory budget is one row over the nodes' x that hold memory. The LP is solved first; if some
x is fractional, the same program is solved as a MIP.

Communication that overlaps compute: part of an edge's cost may be communication of an overlap group
(a unit's parameter gathers and gradient reductions over the data-parallel dims, which the scheduling
passes prefetch and defer), and a node's cost may be compute of a group. That part costs
`OVERLAP_COST` of its time in the objective; one variable e[g] >= 0 per group, with the row
    e[g] >= (the group's communication) - (the group's compute)
and objective weight 1 - OVERLAP_COST, adds what the group's compute cannot cover: overlapped
communication priced as max(0, comm - compute), a convex piecewise-linear term.

HiGHS's answer is used only when it is proven: the LP optimal, or the MIP optimal or stopped at the
time limit with an integer solution within `MIP_GAP` of its bound (the plan then says so in
`method`). Infeasible is `Infeasible` (the caller knows the memory the plan needs); any other
status (time limit without such a solution, unbounded, numerical trouble) is a `SolverError`,
never a choice read off partial values.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import highspy
import numpy as np

from ..config import ConfigError


MIP_GAP = 0.01
"""Relative gap between a time-limited MIP's solution and its bound that we accept as a plan."""

OVERLAP_COST = 0.1
"""The share of its time that communication hidden behind compute still costs a step: NCCL's kernels take SMs
and memory bandwidth from the compute beside them. It also makes, among plans that hide all their
communication, the one that moves fewer bytes the cheaper."""


@dataclass
class ProgramNode:
    costs: list[float]
    memory: list[float] | None = None
    overlaps: int | None = None
    """The overlap group whose communication this node's compute can hide (its unit's kind)."""


@dataclass
class ProgramEdge:
    src: int
    dst: int
    src_group: list[int]
    dst_group: list[int]
    cost: list[list[float]]
    """cost[o][k]; math.inf where layout o cannot become layout k."""
    hidden: int | None = None
    """The overlap group whose compute can hide `hidden_cost`; None: the whole cost blocks compute."""
    hidden_cost: list[list[float]] | None = None
    """The part of cost[o][k] that is the group's communication (the rest, e.g. a copy, blocks compute)."""

    def objective(self, o: int, k: int) -> float:
        if self.hidden is None:
            return self.cost[o][k]
        return self.cost[o][k] - (1.0 - OVERLAP_COST) * self.hidden_cost[o][k]


@dataclass
class Solution:
    choice: list[int]
    objective: float
    variables: int
    constraints: int
    build_s: float
    solve_s: float
    lp_integral: bool
    method: str
    status: str = "optimal"


@dataclass
class _Builder:
    col_cost: list[float] = field(default_factory=list)
    col_ub: list[float] = field(default_factory=list)
    rows: list[tuple[list[int], list[float], float, float]] = field(default_factory=list)

    def add_col(self, cost: float, ub: float = 1.0) -> int:
        self.col_cost.append(cost)
        self.col_ub.append(ub)
        return len(self.col_cost) - 1


def solve(nodes: list[ProgramNode], edges: list[ProgramEdge], memory_budget: float | None, time_limit_s: float = 300.0) -> Solution:
    t0 = time.perf_counter()
    b = _Builder()
    constant = 0.0
    extra = [[0.0] * len(n.costs) for n in nodes]
    banned = [[False] * len(n.costs) for n in nodes]
    pairs_of: dict[int, list[tuple[int, int]]] = {}
    # per overlap group: its communication and compute by column, and the constant part of both
    hidden_comm: dict[int, dict[int, float]] = {}
    hidden_folded: list[tuple[int, int, int, float]] = []
    fixed_comm: dict[int, float] = {}

    for ei, e in enumerate(edges):
        n_o, n_k = max(e.src_group) + 1, max(e.dst_group) + 1
        if n_o == 1 or n_k == 1:
            single_src = n_o == 1
            side, groups = (e.dst, e.dst_group) if single_src else (e.src, e.src_group)
            for s, g in enumerate(groups):
                o, k = (0, g) if single_src else (g, 0)
                if math.isinf(e.cost[o][k]):
                    banned[side][s] = True
                else:
                    extra[side][s] += e.objective(o, k)
                    if e.hidden is not None:
                        hidden_folded.append((e.hidden, side, s, e.hidden_cost[o][k]))
            continue
        pairs_of[ei] = [(o, k) for o in range(n_o) for k in range(n_k) if not math.isinf(e.cost[o][k])]

    x: list[list[int]] = []
    for i, n in enumerate(nodes):
        costs = [c + x_ for c, x_ in zip(n.costs, extra[i])]
        allowed = [s for s in range(len(costs)) if not banned[i][s]]
        if not allowed:
            raise ConfigError("autoparallel: no layout satisfies every constraint of some node; this model cannot be placed on this mesh")
        if len(costs) == 1:
            constant += costs[0]
            x.append([-1])
            continue
        x.append([b.add_col(c, 0.0 if banned[i][s] else 1.0) for s, c in enumerate(costs)])
        b.rows.append((x[i], [1.0] * len(costs), 1.0, 1.0))
    for g, node, s, c in hidden_folded:
        if x[node] == [-1]:
            fixed_comm[g] = fixed_comm.get(g, 0.0) + c
        else:
            col = hidden_comm.setdefault(g, {})
            col[x[node][s]] = col.get(x[node][s], 0.0) + c

    def by_group(node: int, groups: list[int], n: int) -> list[list[int]]:
        """The node's columns of each group, in strategy order (one pass: edges have thousands of strategies)."""
        cols: list[list[int]] = [[] for _ in range(n)]
        for s, g in enumerate(groups):
            cols[g].append(x[node][s])
        return cols

    for ei, pairs in pairs_of.items():
        e = edges[ei]
        y = {p: b.add_col(e.objective(*p), 1.0) for p in pairs}
        if e.hidden is not None:
            col = hidden_comm.setdefault(e.hidden, {})
            for p, c in y.items():
                col[c] = col.get(c, 0.0) + e.hidden_cost[p[0]][p[1]]
        n_o, n_k = max(e.src_group) + 1, max(e.dst_group) + 1
        ys_src: list[list[int]] = [[] for _ in range(n_o)]
        ys_dst: list[list[int]] = [[] for _ in range(n_k)]
        for p in pairs:
            ys_src[p[0]].append(y[p])
            ys_dst[p[1]].append(y[p])
        for ys, cols in zip(ys_src + ys_dst, by_group(e.src, e.src_group, n_o) + by_group(e.dst, e.dst_group, n_k)):
            b.rows.append((ys + cols, [1.0] * len(ys) + [-1.0] * len(cols), 0.0, 0.0))

    # each group's compute, by column, and the part of it that no choice changes
    cover: dict[int, dict[int, float]] = {}
    fixed_compute: dict[int, float] = {}
    for i, n in enumerate(nodes):
        if n.overlaps is None:
            continue
        if x[i] == [-1]:
            fixed_compute[n.overlaps] = fixed_compute.get(n.overlaps, 0.0) + n.costs[0]
        else:
            col = cover.setdefault(n.overlaps, {})
            for c, cost in zip(x[i], n.costs):
                col[c] = col.get(c, 0.0) + cost
    for g in sorted(set(hidden_comm) | set(fixed_comm)):
        terms = dict(hidden_comm.get(g, {}))
        for col, c in cover.get(g, {}).items():
            terms[col] = terms.get(col, 0.0) - c
        exposed = b.add_col(1.0 - OVERLAP_COST, math.inf)
        b.rows.append((list(terms) + [exposed], list(terms.values()) + [-1.0], -math.inf,
                       fixed_compute.get(g, 0.0) - fixed_comm.get(g, 0.0)))

    fixed_memory = 0.0
    if memory_budget is not None:
        cols, vals = [], []
        for i, n in enumerate(nodes):
            if n.memory is None:
                continue
            if x[i] == [-1]:
                fixed_memory += n.memory[0]
            else:
                cols += x[i]
                vals += n.memory
        if cols:
            b.rows.append((cols, vals, -math.inf, memory_budget - fixed_memory))

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("time_limit", time_limit_s)
    n_cols = len(b.col_cost)
    if n_cols == 0:
        return Solution([0] * len(nodes), constant, 0, 0, time.perf_counter() - t0, 0.0, True, "trivial")
    inf = highspy.kHighsInf
    h.addVars(n_cols, np.zeros(n_cols), np.asarray(b.col_ub, dtype=np.float64))
    h.changeColsCost(n_cols, np.arange(n_cols, dtype=np.int32), np.asarray(b.col_cost, dtype=np.float64))
    starts, index, value, lower, upper = [], [], [], [], []
    for cols, vals, lo, up in b.rows:
        starts.append(len(index))
        index += cols
        value += vals
        lower.append(-inf if math.isinf(lo) else lo)
        upper.append(inf if math.isinf(up) else up)
    h.addRows(len(b.rows), np.asarray(lower), np.asarray(upper), len(index), np.asarray(starts, dtype=np.int32),
              np.asarray(index, dtype=np.int32), np.asarray(value, dtype=np.float64))
    t1 = time.perf_counter()
    _run(h, "LP relaxation", time_limit_s)
    values = np.asarray(h.getSolution().col_value)
    xcols = [c for xs in x if xs != [-1] for c in xs]
    integral = _integral(values[xcols])
    method, status = "LP", "optimal"
    if not integral:
        h.changeColsIntegrality(len(xcols), np.asarray(xcols, dtype=np.int32),
                                np.asarray([highspy.HighsVarType.kInteger] * len(xcols)))
        status = _run(h, "MIP", time_limit_s)
        values = np.asarray(h.getSolution().col_value)
        method = "MIP" if status == "optimal" else f"MIP ({status})"
        if not _integral(values[xcols]):
            raise SolverError(f"autoparallel: HiGHS's MIP solution is not integral ({status}); the plan cannot be read from it")
    t2 = time.perf_counter()
    choice = [0 if xs == [-1] else int(np.argmax(values[xs])) for xs in x]
    objective = h.getInfo().objective_function_value + constant
    return Solution(choice, objective, n_cols, len(b.rows), t1 - t0, t2 - t1, integral, method, status)


def _integral(values: np.ndarray) -> bool:
    return bool(np.all(np.minimum(np.abs(values), np.abs(1 - values)) < 1e-6))


def _run(h: highspy.Highs, what: str, time_limit_s: float) -> str:
    """Run HiGHS and return how its answer is proven ("optimal", or the MIP's gap at the time
    limit); raise on anything else."""
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kOptimal:
        return "optimal"
    # every variable is bounded to [0, 1], so "unbounded or infeasible" can only be infeasible
    if status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible):
        raise Infeasible()
    info = h.getInfo()
    if (what == "MIP" and status == highspy.HighsModelStatus.kTimeLimit
            and info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible and info.mip_gap <= MIP_GAP):
        return f"time limit, within {info.mip_gap:.2%} of optimal"
    raise SolverError(
        f"autoparallel: HiGHS stopped the {what} with status '{h.modelStatusToString(status)}' after at most {time_limit_s:g} s "
        f"and no plan proven within {MIP_GAP:.0%} of optimal; plan a smaller mesh, or reuse a plan with --compile.autoparallel_plan"
    )


class Infeasible(Exception):
    """The memory row cannot be met; the caller knows the smallest budget that can."""


class SolverError(ConfigError):
    """HiGHS returned no proven plan: one line for the user, exit code 2."""
