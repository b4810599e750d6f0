"""Bucketing and overlap scheduling of FSDP collectives on a traced graph.

Both passes here plan on the same model (cost_model.py) and rewrite the graph with the same merge:
- `auto_bucketing`: each bucket grows, in the order the collectives are needed, until the alpha-beta
  model says it is bandwidth-bound (its latency term at most 10% of its time), then every bucket is
  placed to overlap compute (see `place`).
- `autoparallel_scheduling` (the autoparallel backend's step): the bucket size is chosen among
  multiples of that size by the simulated step time of the whole schedule, with compute estimated as
  Inductor will run it (fused pointwise ops), since the backend compiles the whole graph afterwards.

The merge (all ranks run the same graph, so every rank issues the same collectives in the same order):
- all-gather: the flattened shards are concatenated and gathered once; the result is viewed as
  [ranks, bucket] and each parameter's columns are copied out into its own full tensor;
- reduce-scatter: each gradient is viewed as [ranks, its shard] and the views are concatenated along
  dim 1, so the flat buffer's rank-r block holds rank r's shard of every gradient; one reduce-scatter
  then gives each rank its shard of each gradient as views of one buffer. Every element is reduced
  exactly as before (same ranks, same op), so results are bitwise equal to the unbucketed graph.
A merged collective carries `node.meta["bucket_size"]` (tensors in it) for the graph dumps.
"""

from __future__ import annotations

import bisect
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from ..graph_dump import BUCKET_META
from ..config import ConfigError
from .bucketing_compat import (
    ALL_GATHER,
    META_AUTOPARALLEL_INSTALL,
    REDUCE_SCATTER,
    WAIT,
    fake_mode_of,
    meta_autobucketing,
    is_fsdp_all_gather,
    is_fsdp_reduce_scatter,
)
from .cost_model import CostModel, Timeline, Transfer, prefix_times, simulate
from .registry import GRAPH_MODES, PassContext, PassSpec, register_pass

logger = logging.getLogger("graph_trainer")
aten = torch.ops.aten

SCHEDULE_META = "collective_schedule"
"""gm.meta key: what the last scheduling pass planned (buckets, estimated times), for logs and tests."""


@dataclass
class Collective:
    """One FSDP all-gather or gradient reduce-scatter and its wait, at positions in graph order."""

    start: fx.Node
    wait: fx.Node
    kind: str
    key: tuple
    """What must match to share a bucket: kind, group, its size, dtype, reduce op, forward/backward."""
    nbytes: int
    """Unsharded bytes: the gathered output, or the reduce-scatter's input."""
    ready: int
    """First position it may be issued at."""
    need: int
    """Position of its first consumer."""
    chain: list[fx.Node]
    """All-gather: the nodes between its parameter input and it (moved earlier with it).
    Reduce-scatter: the one-input nodes between its result and the graph output (moved later)."""
    at: tuple[int, int] = (0, 0)
    """Positions of its issue and wait in the traced graph (the unscheduled baseline)."""
    placeholder: fx.Node | None = None
    output_index: int | None = None

    @property
    def group_size(self) -> int:
        return self.key[2]

    @property
    def group_name(self) -> str:
        return self.key[1]


@dataclass
class Bucket:
    members: list[Collective]
    issue: int = 0
    wait: int = 0

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


def _ancestors_to_placeholder(node: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    seen: dict[fx.Node, None] = {}
    stack = list(node.all_input_nodes)
    placeholder = None
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen[n] = None
        if n.op == "placeholder":
            placeholder = n
        else:
            stack.extend(n.all_input_nodes)
    return placeholder, [n for n in seen if n.op != "placeholder"]


def _descendants_to_output(node: fx.Node) -> tuple[list[fx.Node], fx.Node | None]:
    """The one-input chain below `node` and the value of it the graph returns."""
    chain: list[fx.Node] = []
    returned = None
    stack = [node]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user.op == "output":
                returned = n
            elif user not in chain:
                chain.append(user)
                stack.append(user)
    return chain, returned


def forward_end(gm: fx.GraphModule) -> int:
    """Position of the loss in a train-step graph (forward before it, backward after); the end of
    the graph when the first output is not a loss computed in the graph."""
    order = list(gm.graph.nodes)
    outputs = order[-1].args[0]
    first = outputs[0] if isinstance(outputs, (list, tuple)) and outputs else None
    while isinstance(first, fx.Node) and first.target in (aten.detach.default, aten.alias.default):
        first = first.args[0]
    if not isinstance(first, fx.Node) or first.op == "placeholder":
        return len(order)
    return order.index(first)


def find_collectives(gm: fx.GraphModule) -> list[Collective]:
    order = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    boundary = forward_end(gm)
    outputs = order[-1].args[0]
    out_index = {n: i for i, n in enumerate(outputs) if isinstance(n, fx.Node)} if isinstance(outputs, (list, tuple)) else {}
    found = []
    for node in order:
        if node.op != "call_function" or node.target not in (ALL_GATHER, REDUCE_SCATTER):
            continue
        waits = [u for u in node.users if u.target is WAIT]
        if len(waits) != 1 or len(node.users) != 1:
            continue
        wait, val = waits[0], node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if node.target is ALL_GATHER and is_fsdp_all_gather(node):
            _, group_size, group_name = node.args
            placeholder, chain = _ancestors_to_placeholder(node)
            need = min((pos[u] for u in wait.users), default=len(order) - 1)
            key = ("all_gather", group_name, group_size, val.dtype, None, need <= boundary)
            found.append(Collective(node, wait, "all_gather", key, val.numel() * val.element_size(),
                                    pos[placeholder] + 1, need, chain, (pos[node], pos[wait]), placeholder=placeholder))
        elif node.target is REDUCE_SCATTER and is_fsdp_reduce_scatter(node):
            source, reduce_op, group_size, group_name = node.args
            src_val = source.meta["val"]
            chain, returned = _descendants_to_output(wait)
            key = ("reduce_scatter", group_name, group_size, val.dtype, reduce_op, False)
            found.append(Collective(node, wait, "reduce_scatter", key, src_val.numel() * src_val.element_size(),
                                    pos[source] + 1, len(order) - 1, chain, (pos[node], pos[wait]),
                                    output_index=out_index.get(returned)))
    return found


# ---------------------------------------------------------------------------------------------
# Planning: which collectives share a bucket, and where each bucket is issued and waited for.


@dataclass
class Layout:
    """The graph's positions as the planners see them: collective nodes and the chains that move
    with them take no compute time and are never used as anchors."""

    order: list[fx.Node]
    prefix: list[float]
    stable: list[int]
    """Positions of nodes that stay where they are (anchors for inserted nodes), ascending."""

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


def layout(gm: fx.GraphModule, colls: list[Collective], model: CostModel) -> Layout:
    order = list(gm.graph.nodes)
    moving = {c.start for c in colls} | {c.wait for c in colls}
    for c in colls:
        moving.update(c.chain)
    times = [0.0 if n in moving else model.node_time(n) for n in order]
    stable = [i for i, n in enumerate(order) if n not in moving and n.op != "placeholder"]
    return Layout(order, prefix_times(times), stable)


def size_runs(colls: list[Collective], cap: Callable[[Collective], int]) -> list[Bucket]:
    """Consecutive collectives (all-gathers by first use, reduce-scatters by readiness) of one key
    share a bucket until it holds `cap(first member)` bytes."""
    buckets: list[Bucket] = []
    for kind, sort_key in (("all_gather", "need"), ("reduce_scatter", "ready")):
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
    Reduce-scatters: issued as soon as the last gradient of the bucket exists; the wait goes where the
    model expects it done, which frees the gradient buffers early without stalling.
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
    comm_free = 0.0
    end = len(lay.order) - 1
    for b in sorted((b for b in buckets if b.kind == "reduce_scatter"), key=lambda b: b.ready):
        b.issue = b.ready
        comm_free = max(lay.prefix[b.issue], comm_free) + _comm_time(b, model)
        b.wait = lay.first_at_or_after(comm_free, b.issue, end)


def _comm_time(b: Bucket, model: CostModel) -> float:
    first = b.members[0]
    return model.collective_time(b.kind, b.nbytes, first.group_size, first.group_name)


def transfers(buckets: list[Bucket], model: CostModel) -> list[Transfer]:
    out = []
    for b in buckets:
        merged = len(b.members) > 1
        ranks = b.members[0].group_size
        if b.kind == "all_gather":
            copy_in, copy_out = model.copy_time(b.nbytes // ranks), model.copy_time(b.nbytes)
        else:
            copy_in, copy_out = model.copy_time(b.nbytes), 0.0
        out.append(Transfer(b.issue, b.wait, _comm_time(b, model),
                            model.hw.launch_s + (copy_in if merged else 0.0), copy_out if merged else 0.0))
    return out


def estimate(buckets: list[Bucket], lay: Layout, model: CostModel) -> Timeline:
    return simulate(lay.prefix, transfers(buckets, model))


# ---------------------------------------------------------------------------------------------
# Rewriting the graph to a plan.


def emit(graph: fx.Graph, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    """A new call node with its `meta["val"]` computed on the fake values of its inputs."""
    node = graph.call_function(target, args, kwargs)
    vargs, vkwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    if target is operator.getitem:
        node.meta["val"] = vargs[0][vargs[1]]
    else:
        leaves: list[Any] = []
        fx.node.map_aggregate((vargs, vkwargs), leaves.append)
        with fake_mode_of(leaves):
            node.meta["val"] = target(*vargs, **vkwargs)
    return node


def _contiguous(graph: fx.Graph, node: fx.Node) -> fx.Node:
    if node.meta["val"].is_contiguous():
        return node
    return emit(graph, aten.clone.default, node, memory_format=torch.contiguous_format)


def _positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _hoist(chain: list[fx.Node], before: fx.Node) -> None:
    """Move the nodes of an all-gather's input chain that come after `before` to just before it."""
    pos = _positions(before.graph)
    for n in sorted(chain, key=pos.__getitem__):
        if pos[n] > pos[before]:
            before.prepend(n)


def _issue(graph: fx.Graph, b: Bucket, anchor: fx.Node) -> fx.Node:
    members = b.members
    if b.kind == "all_gather":
        for m in members:
            _hoist(m.chain, anchor)
    if len(members) == 1:
        anchor.prepend(members[0].start)
        return members[0].start
    first = members[0]
    with graph.inserting_before(anchor):
        if b.kind == "all_gather":
            flats = [emit(graph, aten.view.default, _contiguous(graph, m.start.args[0]), [-1]) for m in members]
            flat = emit(graph, aten.cat.default, flats)
            start = emit(graph, ALL_GATHER, flat, first.group_size, first.group_name)
        else:
            ranks = first.group_size
            rows = []
            for m in members:
                source = _contiguous(graph, m.start.args[0])
                rows.append(emit(graph, aten.view.default, source, [ranks, source.meta["val"].numel() // ranks]))
            stacked = emit(graph, aten.cat.default, rows, 1)
            flat = emit(graph, aten.view.default, stacked, [-1])
            start = emit(graph, REDUCE_SCATTER, flat, first.key[4], ranks, first.group_name)
    start.meta[BUCKET_META] = len(members)
    return start


def _wait(graph: fx.Graph, b: Bucket, start: fx.Node, anchor: fx.Node) -> list[fx.Node]:
    """Insert the bucket's wait (and copy-out) before `anchor`; returns the nodes inserted last,
    after which a reduce-scatter's output chains go."""
    members = b.members
    if len(members) == 1:
        anchor.prepend(members[0].wait)
        return [members[0].wait]
    ranks = members[0].group_size
    with graph.inserting_before(anchor):
        wait = emit(graph, WAIT, start)
        if b.kind == "all_gather":
            sizes = [m.start.args[0].meta["val"].numel() for m in members]
            grid = emit(graph, aten.view.default, wait, [ranks, sum(sizes)])
            parts = emit(graph, aten.split_with_sizes.default, grid, sizes, 1)
            outs = []
            for i, m in enumerate(members):
                part = emit(graph, operator.getitem, parts, i)
                dense = emit(graph, aten.clone.default, part, memory_format=torch.contiguous_format)
                outs.append(emit(graph, aten.view.default, dense, list(m.wait.meta["val"].shape)))
        else:
            sizes = [m.wait.meta["val"].numel() for m in members]
            parts = emit(graph, aten.split_with_sizes.default, wait, sizes)
            outs = [
                emit(graph, aten.view.default, emit(graph, operator.getitem, parts, i), list(m.wait.meta["val"].shape))
                for i, m in enumerate(members)
            ]
    for m, out in zip(members, outs):
        m.wait.replace_all_uses_with(out)
        graph.erase_node(m.wait)
        graph.erase_node(m.start)
    return outs


def rewrite(gm: fx.GraphModule, buckets: list[Bucket], lay: Layout) -> None:
    """Merge each bucket and move its issue and wait to the planned anchors. All issues are inserted
    before all waits, so at a shared anchor the next collective is in flight before the wait."""
    graph = gm.graph
    starts = [(b, _issue(graph, b, lay.anchor(b.issue))) for b in buckets]
    for b, start in starts:
        last = _wait(graph, b, start, lay.anchor(max(b.wait, b.issue)))
        if b.kind == "reduce_scatter":
            cursor = last[-1]
            pos = _positions(graph)
            for n in sorted({n for m in b.members for n in m.chain}, key=pos.__getitem__):
                cursor.append(n)
                cursor = n
    graph.lint()
    gm.recompile()


# ---------------------------------------------------------------------------------------------
# The passes.


def schedule(gm: fx.GraphModule, buckets: list[Bucket], lay: Layout, model: CostModel, name: str,
             placed: bool = False) -> fx.GraphModule:
    """Place (unless the caller did), estimate, record and rewrite."""
    if not placed:
        place(buckets, lay, model)
    before = estimate([Bucket([m], *m.at) for b in buckets for m in b.members], lay, model)
    after = estimate(buckets, lay, model)
    counts = {k: sum(1 for b in buckets if b.kind == k) for k in ("all_gather", "reduce_scatter")}
    gm.meta[SCHEDULE_META] = {
        "pass": name,
        "hardware": model.hw.name,
        "buckets": counts,
        "collectives_before": sum(len(b.members) for b in buckets),
        "estimated_step_s": after.step_s,
        "estimated_exposed_comm_s": after.exposed_comm_s,
        "unscheduled_step_s": before.step_s,
        "unscheduled_exposed_comm_s": before.exposed_comm_s,
        "issue_lead_positions": [b.need - b.issue for b in buckets if b.kind == "all_gather"],
    }
    logger.info(
        f"{name}: {gm.meta[SCHEDULE_META]['collectives_before']} collectives -> {counts['all_gather']} all-gather "
        f"and {counts['reduce_scatter']} reduce-scatter buckets; estimated step {after.step_s * 1e3:.2f} ms "
        f"({after.exposed_comm_s * 1e3:.2f} ms exposed comm) vs {before.step_s * 1e3:.2f} ms "
        f"({before.exposed_comm_s * 1e3:.2f} ms) unbucketed, on the {model.hw.name} model"
    )
    rewrite(gm, buckets, lay)
    return gm


def saturating_cap(model: CostModel, scale: float = 1.0) -> Callable[[Collective], int]:
    def cap(c: Collective) -> int:
        size = model.saturating_bytes(c.kind, c.group_size, c.group_name) * scale
        return int(min(size, model.hw.max_bucket_bytes))

    return cap


def auto_bucketing(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    colls = find_collectives(gm)
    if not colls:
        return gm
    model = CostModel.for_context(ctx)
    lay = layout(gm, colls, model)
    return schedule(gm, size_runs(colls, saturating_cap(model)), lay, model, "auto_bucketing")


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


def meta_scheduling(gm: fx.GraphModule) -> fx.GraphModule:
    """Meta AutoParallel's aten bucketing + reordering (torch's overlap scheduler underneath: CUDA only)."""
    found = meta_autobucketing()
    if found is None:
        raise ConfigError(f"--compile.autoparallel_impl meta needs Meta's autoparallel package: {META_AUTOPARALLEL_INSTALL}")
    fn, base = found
    config = type("GraphTrainerAutobucketing", (base,), {"collective_bucketing": True, "save_trace": False})
    return fn(gm.graph, config)


def autoparallel_scheduling(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.cfg.compile.autoparallel_impl == "meta":
        return meta_scheduling(gm)
    colls = find_collectives(gm)
    if not colls:
        return gm
    model = CostModel.for_context(ctx, fused=True)
    lay = layout(gm, colls, model)
    return schedule(gm, choose_buckets(colls, lay, model), lay, model, "autoparallel_scheduling", placed=True)


_BUCKETING = ("auto_bucketing", "transformer_block_bucketing", "autoparallel_scheduling")

register_pass(PassSpec(
    name="auto_bucketing",
    description="bucket FSDP all-gathers/reduce-scatters to the alpha-beta model's bandwidth-saturating "
                "size and place them to overlap compute (roofline estimates)",
    stages=("train_step", "forward", "backward", "joint"),
    modes=GRAPH_MODES,
    fn=auto_bucketing,
    conflicts=tuple(p for p in _BUCKETING if p != "auto_bucketing"),
    excluded_backends=("autoparallel_backend",),
))
register_pass(PassSpec(
    name="autoparallel_scheduling",
    description="autoparallel backend's collective schedule: bucket size and issue points chosen by the "
                "simulated step time (alpha-beta comm, roofline compute of the fused graph)",
    # Not the aot joint graph: the partitioner reorders its nodes afterwards. On aot's forward and
    # backward graphs it schedules each graph's own collectives.
    stages=("train_step", "forward", "backward"),
    modes=GRAPH_MODES,
    fn=autoparallel_scheduling,
    conflicts=tuple(p for p in _BUCKETING if p != "autoparallel_scheduling"),
))
