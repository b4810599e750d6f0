"""Planning: which collectives share a bucket (by size, or one bucket per transformer block), where
each bucket is issued and waited for, and the step time the cost model expects from a plan (the one estimator the scheduling
passes and the autoparallel backend use) or from a graph as it stands (`as_issued`: the run's prediction file)."""

from __future__ import annotations

import bisect
import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable

from torch import fx

from ..graph_dump import collective_kind
from ..parallel import policy_name
from .bucketing_compat import WAIT
from .collectives import ORDER_BY, REDUCTIONS, Collective, find_collectives
from .cost_model import CostModel, Timeline, Transfer, prefix_times, simulate


@dataclass
class Bucket:
    members: list[Collective]
    issue: int = 0
    wait: int = 0
    block: int | None = None
    """The transformer block of a per-block bucket (`block_buckets`); None for others."""

    @property
    def kind(self) -> str:
        return self.members[0].kind

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.members)

    @property
    def need(self) -> int:
        return min(m.need for m in self.members)

    @property
    def ready(self) -> int:
        return max(m.ready for m in self.members)


@dataclass
class Layout:
    """The graph's positions as the planners see them: collective nodes and the chains that move
    with them take no compute time and are never used as anchors."""

    order: list[fx.Node]
    prefix: list[float]
    stable: list[int]
    """Positions of nodes that stay where they are (anchors for inserted nodes), ascending."""
    fixed: list[Transfer] = dataclasses.field(default_factory=list)
    """The collectives the planners do not move (tensor-parallel activations, all-reduces,
    all-to-alls), where the traced graph issues and waits for them: on the communication stream from
    issue to wait, compute stalling at the wait."""

    def anchor(self, position: int) -> fx.Node:
        i = bisect.bisect_left(self.stable, position)
        return self.order[self.stable[min(i, len(self.stable) - 1)]]

    def latest_at_or_before(self, time_s: float, lo: int, hi: int) -> int:
        """The last position in [lo, hi] compute reaches no later than `time_s` (lo if none)."""
        p = bisect.bisect_right(self.prefix, time_s) - 1
        return max(lo, min(p, hi))

    def first_at_or_after(self, time_s: float, lo: int, hi: int) -> int:
        p = bisect.bisect_left(self.prefix, time_s)
        return max(lo, min(p, hi))


def fixed_transfers(order: list[fx.Node], planned: set[fx.Node], model: CostModel) -> list[Transfer]:
    """Every collective with one wait that is not in `planned`, issued and waited for where the graph
    has it. A wait that directly follows its collective blocks compute for the collective's time; a
    wait further down lets the collective overlap the compute in between (and run the slower for it)."""
    pos = {n: i for i, n in enumerate(order)}
    fixed = []
    for i, n in enumerate(order):
        kind = collective_kind(n)
        waits = [u for u in n.users if u.target is WAIT]
        if kind is None or n in planned or len(waits) != 1:
            continue
        wait = pos[waits[0]]
        overlaps = wait > i + 1
        slows = model.compute_slowdown(model.group_size(n, kind)) if overlaps else 0.0
        comm_s = model.collective_node_time(n, kind, beside_compute=overlaps)
        fixed.append(Transfer(i, wait, comm_s, model.hw.launch_s + slows, channel=n.args[-1], kind=kind))
    return fixed


def layout(gm: fx.GraphModule, colls: list[Collective], model: CostModel) -> Layout:
    order = list(gm.graph.nodes)
    moving = {c.start for c in colls} | {c.wait for c in colls}
    for c in colls:
        moving.update(c.chain)
    fixed = fixed_transfers(order, {c.start for c in colls}, model)
    times = model.graph_times(order, moving | {order[t.issue] for t in fixed})
    stable = [i for i, n in enumerate(order) if n not in moving and n.op != "placeholder"]
    return Layout(order, prefix_times(times), stable, fixed)


def size_runs(colls: list[Collective], cap: Callable[[Collective], int]) -> list[Bucket]:
    """Consecutive collectives (all-gathers by first use, reductions by readiness) of one key share a
    bucket until it holds `cap(first member)` bytes."""
    buckets: list[Bucket] = []
    for kind, sort_key in ORDER_BY.items():
        current: list[Collective] = []
        for c in sorted((c for c in colls if c.kind == kind), key=lambda c: getattr(c, sort_key)):
            if current and (c.key != current[0].key or sum(m.nbytes for m in current) >= cap(current[0])):
                buckets.append(Bucket(current))
                current = []
            current.append(c)
        if current:
            buckets.append(Bucket(current))
    return buckets


def place(buckets: list[Bucket], lay: Layout, model: CostModel) -> None:
    """Issue points and waits from the model.

    All-gathers: as late as still hides each bucket's estimated time behind compute before its first
    use, given that the buckets run one after another (walked from the last bucket back), then
    pushed later where more than `max_in_flight_bytes` would be in flight. Waits sit at the first use.
    Reductions: issued as soon as the last gradient of the bucket exists; the wait goes where the
    model expects it done (its communicator runs them in issue order), which frees the gradient buffers
    early without stalling.
    """
    gathers = sorted((b for b in buckets if b.kind == "all_gather"), key=lambda b: b.need)
    latest_finish = float("inf")
    for b in reversed(gathers):
        finish = min(lay.prefix[b.need], latest_finish)
        start_by = finish - _comm_time(b, model)
        b.issue = lay.latest_at_or_before(start_by, b.ready, b.need)
        b.wait = b.need
        latest_finish = start_by
    cap = model.hw.max_in_flight_bytes
    for k, b in enumerate(gathers):
        b.issue = max(b.issue, gathers[k - 1].issue if k else b.issue)
        while True:
            in_flight = [g for g in gathers[:k] if g.issue <= b.issue < g.need]
            if not in_flight or sum(g.nbytes for g in in_flight) + b.nbytes <= cap:
                break
            b.issue = min(g.need for g in in_flight)
    end = len(lay.order) - 1
    reductions = sorted((b for b in buckets if b.kind in REDUCTIONS), key=lambda b: b.ready)
    for b in reductions:
        b.issue = b.ready
    _wait_when_done(reductions, [min(end, b.need) for b in reductions], lay, model)


def _wait_when_done(reductions: list[Bucket], latest: list[int], lay: Layout, model: CostModel,
                    moves: Callable[[Bucket], bool] = lambda b: True) -> None:
    """Wait for each reduction that `moves` (issued, in issue order) where the model expects it done, its
    communicator running them one after another, and no later than `latest` (the others at `latest`): its
    input buffer is freed as soon as that costs no stall."""
    comm_free: dict[str, float] = {}
    for b, last in zip(reductions, latest):
        channel = b.members[0].group_name
        comm_free[channel] = max(lay.prefix[b.issue], comm_free.get(channel, 0.0)) + _comm_time(b, model)
        b.wait = lay.first_at_or_after(comm_free[channel], b.issue, last) if moves(b) else last


def _comm_time(b: Bucket, model: CostModel) -> float:
    """A bucket is placed to overlap compute."""
    first = b.members[0]
    return model.collective_time(b.kind, b.nbytes, first.group_size, first.group_name, beside_compute=True)


def transfers(buckets: list[Bucket], model: CostModel) -> list[Transfer]:
    out = []
    for b in buckets:
        merged = len(b.members) > 1
        ranks = b.members[0].group_size
        if b.kind == "all_gather":
            copy_in, copy_out = model.copy_time(b.nbytes // ranks), model.copy_time(b.nbytes)
        else:
            copy_in, copy_out = model.copy_time(b.nbytes), 0.0
        issue_cost = model.hw.launch_s + model.compute_slowdown(ranks) + (copy_in if merged else 0.0)
        out.append(Transfer(b.issue, b.wait, _comm_time(b, model), issue_cost, copy_out if merged else 0.0,
                            b.members[0].group_name, b.kind))
    return out


def estimate(buckets: list[Bucket], lay: Layout, model: CostModel) -> Timeline:
    return simulate(lay.prefix, transfers(buckets, model) + lay.fixed)


def saturating_cap(model: CostModel, scale: float = 1.0) -> Callable[[Collective], int]:
    def cap(c: Collective) -> int:
        size = model.saturating_bytes(c.kind, c.group_size, c.group_name) * scale
        return int(min(size, model.hw.max_bucket_bytes))

    return cap


BUCKET_SCALES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
"""Bucket sizes autoparallel_scheduling tries, as multiples of the bandwidth-saturating size."""


def choose_buckets(colls: list[Collective], lay: Layout, model: CostModel) -> list[Bucket]:
    """The bucketing with the lowest simulated step time (fewer collectives on ties)."""
    best: tuple[float, int] | None = None
    chosen: list[Bucket] = []
    for scale in BUCKET_SCALES:
        buckets = size_runs(colls, saturating_cap(model, scale))
        place(buckets, lay, model)
        score = (round(estimate(buckets, lay, model).step_s, 9), len(buckets))
        if best is None or score < best:
            best, chosen = score, buckets
    return chosen


def saturating_plan(gm: fx.GraphModule, model: CostModel) -> tuple[list[Bucket], Layout]:
    """`auto_bucketing`'s plan: the graph's FSDP collectives bucketed to the saturating size and
    placed to overlap compute."""
    colls = find_collectives(gm)
    lay = layout(gm, colls, model)
    buckets = size_runs(colls, saturating_cap(model))
    place(buckets, lay, model)
    return buckets, lay


def as_issued(gm: fx.GraphModule, model: CostModel) -> Timeline:
    """The step of the graph as it stands: every collective on its communicator from where the graph
    issues it to its wait, and whatever a scheduling pass inserted (bucket copies) priced as compute."""
    lay = layout(gm, [], model)
    return simulate(lay.prefix, lay.fixed)


# Per-block plans: one bucket per transformer block and kind (transformer_block_bucketing; the
# autoparallel backend's scheduling on a step of transformer blocks).

_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def block_of(fqn: str) -> int | None:
    match = _BLOCK.search(fqn)
    return int(match.group(1)) if match else None


def _param_index(c: Collective, placeholders: dict[fx.Node, int], num_params: int) -> int | None:
    if c.kind == "all_gather":
        index = placeholders.get(c.placeholder)
    elif c.update_index is not None:
        index = c.update_index
    else:
        index = None if c.output_index is None else c.output_index - 1
    return index if index is not None and 0 <= index < num_params else None


def frees_early(cfg: Any) -> bool:
    """Whether the per-block plan frees the gradient buffers outside the blocks early (`block_buckets`' `alone`,
    `place_per_block` given the model): under a memory budget (`--activation_checkpoint.mode memory_budget`), where
    the memory it saves is recomputation the policy avoids (0.7 GiB of the peak at llama3 8B cut to 16 layers, dp_shard
    2, bench/results/2026-11-30-session27). Elsewhere it would only add distinct pieces to compile, waits and
    reductions inside the first backward block and the loss's piece (llama3 1B at dp_shard 2, traced on a CPU: 14
    against 10)."""
    return policy_name(cfg) == "memory_budget"


def block_buckets(gm: fx.GraphModule, colls: list[Collective], fqns: list[str], alone: bool = False) -> list[Bucket]:
    """Collectives grouped by (kind, block or run of non-block parameters, collective key); with `alone`, a gradient
    reduction outside the blocks is a bucket of its own: bucketed with the final norm's, the output projection's fp32
    gradient is copied into the bucket beside itself (2 x 1.96 GiB at llama3 8B, dp_shard 2: the step's peak once
    the reduction is waited for inside the first backward block)."""
    placeholders = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    buckets: list[Bucket] = []
    for kind, order_by in ORDER_BY.items():
        groups: dict[tuple, list[Collective]] = {}
        run, previous_block = 0, -1
        for c in sorted((c for c in colls if c.kind == kind), key=lambda c: getattr(c, order_by)):
            index = _param_index(c, placeholders, len(fqns))
            block = block_of(fqns[index]) if index is not None else None
            if block is None and previous_block is not None:
                run += 1
            previous_block = block
            where = block if block is not None else (run, id(c)) if alone and kind in REDUCTIONS else run
            groups.setdefault((c.key, "block" if block is not None else "rest", where), []).append(c)
        buckets += [Bucket(members, block=where if part == "block" else None) for (_, part, where), members in groups.items()]
    return buckets


PREFETCH_DEPTHS = (1, 2, 3)


def place_per_block(buckets: list[Bucket], depth: int = 1, lay: Layout | None = None, model: CostModel | None = None) -> None:
    """Each block's all-gather issued where the one `depth` blocks earlier is first used; each reduction issued when
    its gradients exist and waited for by the next reduction of its kind (two in flight at most; one outside the
    blocks by the next block's). Given the layout and the model, a reduction outside the blocks is waited for where
    the model expects it done if that is earlier (`_wait_when_done`): the output projection's fp32 gradient bucket
    (1.96 GiB at llama3 8B, dp_shard 2) was otherwise in flight through the first block's backward, where the step
    peaks (0.3 GiB off its measured peak, bench/results/2026-11-30-session27). A block's own reductions stay where
    they were: waits at positions that differ from block to block make blocks distinct pieces to compile (17 for 16
    layers, against 14 with only the reductions outside the blocks moved and 12 with none)."""
    gathers = sorted((b for b in buckets if b.kind == "all_gather"), key=lambda b: b.need)
    for k, b in enumerate(gathers):
        b.issue = max(b.ready, gathers[k - depth].need) if k >= depth else b.ready
        b.wait = b.need
    # a block's all-reduce (its replicated parameters' gradients, issued beside its reduce-scatter) must not cut the
    # reduce-scatter's overlap short: waited for at the next reduction of any kind, that left 28 ms of an auto-placed
    # 8B-16L step's reduce-scatters exposed on 2 H200s (bench/results/2026-11-30-session24)
    for kind in REDUCTIONS:
        reductions = sorted((b for b in buckets if b.kind == kind), key=lambda b: b.ready)
        # one outside the blocks is in flight to the next block's at most (the final norm's, ready right after the
        # output projection's, must not end the latter's overlap)
        latest = [min(next((r.ready for r in reductions[k + 1:] if b.block is not None or r.block is not None), b.need), b.need)
                  for k, b in enumerate(reductions)]
        for b, last in zip(reductions, latest):
            b.issue, b.wait = b.ready, last
        if lay is not None and model is not None:
            _wait_when_done(reductions, latest, lay, model, lambda b: b.block is None)


def gathered_in_flight(buckets: list[Bucket]) -> int:
    """The most all-gathered bytes issued and not yet consumed at once."""
    gathers = [b for b in buckets if b.kind == "all_gather"]
    return max((sum(g.nbytes for g in gathers if g.issue <= b.issue < g.need or g is b) for b in gathers), default=0)


def block_plans(gm: fx.GraphModule, colls: list[Collective], fqns: list[str], lay: Layout,
                model: CostModel, free_early: bool = False) -> list[tuple[tuple[float, int], list[Bucket]]]:
    """The per-block plan at each prefetch depth that fits in flight, scored (step seconds, depth); `free_early`:
    see `frees_early`."""
    plans = []
    for depth in PREFETCH_DEPTHS:
        buckets = block_buckets(gm, colls, fqns, alone=free_early)
        place_per_block(buckets, depth, *((lay, model) if free_early else ()))
        if depth > 1 and gathered_in_flight(buckets) > model.hw.max_in_flight_bytes:
            break
        plans.append(((round(estimate(buckets, lay, model).step_s, 9), depth), buckets))
    return plans
