"""memory_policy: for every activation the backward needs, save it, recompute it in backward, or
offload it to host memory and reload it before backward needs it.

An activation is a forward value of the train-step graph that backward reads and that is computed
from the batch (values computed from parameters alone, such as gathered weights and their casts, are
`reshard_after_forward`'s business). Saving it costs its bytes from forward to backward; recomputing
it costs the time of the ops that rebuild it from values that are saved anyway. The policy chooses,
then the rewrite duplicates each recomputed chain just before its first backward use, so the
forward copy dies after its last forward use. Recomputation repeats the same ops on the same inputs,
so the step's results are bitwise those of the graph without the pass.

Two policies:
- `memory_budget` (`--activation_checkpoint.mode memory_budget`): greedy under a budget for the step's
  peak memory, `--activation_checkpoint.memory_budget`. The peak is simulated (`liveness`) over the
  graph as the rewrite would leave it, in execution order: every value the graph makes (activations,
  backward's transients such as the fp32 logits and their gradient, gathered parameters, gradients
  accumulating as outputs) from its op to its last reader, plus what the step holds throughout (the
  graph's inputs: parameter shards, buffers, batch; AdamW's two moments unless the update is in the
  graph; earlier microbatches' gradients under accumulation). While the peak exceeds the budget,
  recompute, among the activations live at the peak, the storage that frees the most bytes per second
  of recomputation (time from the cost model's roofline), re-scoring lazily and re-simulating once per
  round of choices. Each recomputation is one transformer block's ops from values saved anyway: what a
  block hands on (the residual stream) is saved, since a chain through blocks would rebuild every
  earlier block's values at the first backward read and hold them until their own backward. A
  recomputation that reads a parameter backward gathers again (`reshard_after_forward`) gathers it
  again, merged with backward's own gather, so forward's gathered copy still dies in forward; a gather
  it adds (a parameter backward does not read, such as the embedding table) is priced into its cost.
  When recomputing what helps cannot bring the peak under the budget, one warning gives the peak
  reached. Under a whole-graph Inductor compile the simulation leaves out the values Inductor fuses
  into their readers (`fusion`: the cross-entropy's fp32 log-softmax and its gradient). The backend's
  later passes (`PassContext.later_passes`: the collective schedule, whose buckets stay in flight
  through the next block and whose gathers are prefetched) hold memory this graph does not show: the
  policy runs them on a copy of its rewrite, adds what they held as each op ran to its simulation and
  plans again, until the step as they leave it fits (`ac_scheduled_peak_gib`). In `aot` the
  min-cut partitioner chooses instead, under its own knob: the share of its activations to keep, set
  to the budget less 4x the parameter shards (no simulation).
- `op` (`--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op`):
  torchtitan's op-level policy on each transformer block: save the outputs of the ops on its save
  list (every other matmul, attention, ...), recompute the rest; a block's outputs are saved.

Offload (`--activation_checkpoint.offload`, memory_budget in aot_fx_trace): before recomputing, the
budget policy offloads the activations live at the peak whose copies to host memory and back the
compute between their last forward read and first backward read hides (`transfers`: the host link of
`Hardware`, each direction a FIFO queue, copy times with a margin), the dearest to recompute per byte
first, skipping those whose recomputation costs less than the two copies' launches. The rewrite adds
`offload_ops`' four nodes per activation (offload after it is made, its wait once the copy is done,
the reload early enough in backward, its wait before the first backward use); the simulation counts
the activation freed from the offload's wait to the reload, and the reloaded copy live from the reload
to its last backward read. `auto` (the default) never offloads on the CPU (no host link) nor under a
whole-graph Inductor compile; `always` offloads every activation that can be (to test it), `never` none.
The copies are exact, so the step's results stay bitwise those of the graph without the pass.

The chosen policy and the simulated peak with it and without (`ac_peak_gib`, `ac_peak_baseline_gib`, of
which `ac_persistent_gib` is held throughout) go into the log, into `ctx.report` (the step-1 metrics
record's `ac_*` keys) and into the `memory_policy` stage of the graph dumps, where every recomputed node is named
`recompute_<forward name>` and carries `node.meta["memory_policy"] = "recomputed"`, and the transfers of
an offloaded one are `offload_`, `wait_offload_`, `reload_`, `wait_reload_<forward name>`, with
`node.meta["memory_policy"] = "offloaded"`.

This module holds the pass and its two policies; what they work on and with lives beside it:
activations.py (the activations and what can be recomputed or offloaded), recompute.py (the saved set
of a choice, the simulated schedule and the rewrite), offload_choice.py (which activations to offload,
and their transfers in the graph), memory_report.py (the log line and the report).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Callable, Collection, Hashable, Mapping

import torch
from torch import fx

from ..graph_dump import nbytes
from ..hardware import select
from ..blocks import node_block
from ..parallel import OP_SAC_SAVE_LIST, policy_name
from ..units import GiB, fill_device, parse_memory_budget
from .activations import Activations
from .bucket_plan import block_buckets
from .collectives import REDUCTIONS, find_collectives, forward_end
from .cost_model import CostModel
from .fusion import FUSING_BACKENDS, unmaterialized
from .liveness import Profile, Simulator, Step, graph_schedule
from .memory_report import report_partition, report_policy, report_train_step
from .offload_choice import NEVER, OFFLOAD_BACKENDS, Offload, choose_offloads, loss_step, offload_in_backward
from .recompute import Ledger, Policy, recompute_in_backward, recomputed_bytes, schedule
from .transfers import Transfer, place, with_transfers
from .registry import PASSES, PassContext, PassSpec, register_pass

MAX_MISSES = 8
"""Rounds in a row that fail to lower the simulated peak before the budget policy gives up."""
SCHEDULE_ROUNDS = 3
"""Plans the budget policy makes at most to fit the step as the collective schedule leaves it."""


def offload_mode(cfg: Any) -> str:
    """`--activation_checkpoint.offload` as the pass applies it: only the budget policy of aot_fx_trace
    offloads, and `auto` only where the step graph runs op by op (a whole-graph Inductor compile is
    not known to keep the transfers where the pass puts them) and outside a CUDA graph (whose capture
    cannot allocate pinned host memory); validation refuses `always` in both cases."""
    ac = cfg.activation_checkpoint
    if policy_name(cfg) != "memory_budget" or cfg.compile.mode != "aot_fx_trace":
        return "never"
    if ac.offload == "auto" and (cfg.compile.inductor_compilation not in OFFLOAD_BACKENDS or "cudagraph" in cfg.compile.passes):
        return "never"
    return ac.offload


def activation_passes(cfg: Any) -> list[str]:
    """The passes `--activation_checkpoint` adds in front of the backend's (validated with them)."""
    ac = cfg.activation_checkpoint
    pointwise = cfg.compile.mode == "aot_fx_trace" and ac.recompute_pointwise
    # joint graphs (aot, pipeline stages) hold no recomputation of a wrapped block until tagged
    joint = cfg.compile.mode == "aot" or cfg.compile.mode == "aot_fx_trace" and cfg.parallelism.pp > 1
    policy = policy_name(cfg)
    tags = joint and ac.mode in ("full", "selective") and policy is None
    return (["checkpoint_tags"] if tags else []) + (["recompute_pointwise"] if pointwise else []) + (["memory_policy"] if policy else [])


def plan_memory_budget(acts: Activations, budget_bytes: float, node_time: Callable[[fx.Node], float],
                       offload: Offload = NEVER, fused: Collection[fx.Node] = frozenset(),
                       extra: Mapping[fx.Node, int] | None = None) -> Policy:
    """Greedy on the simulated peak of the graph's own values (`budget_bytes`: the step's budget less
    what it holds besides them), offloading first, then recomputing.

    Offload (`offload.mode` auto): while the peak exceeds the budget, offload the activations live at
    the peak whose transfers compute hides (`transfers.place`: no exposed wait, both directions of the
    host link as FIFO queues shared by every offload chosen so far), the dearest to recompute per byte
    first, each kept only if the simulated peak falls. An offload costs no compute where it is hidden,
    so it beats recomputing whatever it can cover; where there is no host link (CPU) nothing is hidden
    and nothing is offloaded. `always` offloads every activation that can be (a storage of its own
    read whole by backward, with steps between its last forward read and first backward read),
    hidden or not. The recomputation below never touches an offloaded activation.

    Recompute: each round, while the peak exceeds the budget, recompute held
    storages live at the peak, the most bytes freed per second of recomputation first (scores
    refreshed lazily: a popped candidate whose fresh score is below the next one's goes back into the
    heap), until their bytes cover the excess; then simulate again. A round that does not lower the
    peak is undone and retried with half the bytes (a lone candidate that does not help is dropped);
    `MAX_MISSES` such rounds in a row end the search. `fused`: the values the compiler never writes;
    `extra`: bytes later passes hold from each node on (`liveness`)."""
    ledger = Ledger(acts)
    baseline = ledger.bytes
    # A chain that crossed blocks would rebuild earlier blocks' values at the first backward read and hold
    # them until their own block's backward (through every block, the whole forward at once): the values
    # a block hands on are saved, so each recomputation is one block's ops from its saved inputs.
    edges = _block_edges(acts)
    simulator = Simulator(fused, extra)
    times: dict[fx.Node, float] = {}

    def node_time_of(node: fx.Node) -> float:
        if node not in times:
            times[node] = node_time(node)
        return times[node]

    def build(rc: set[fx.Node], offloaded: set[fx.Node]) -> tuple[list[Step], dict[fx.Node, Transfer]]:
        steps = schedule(acts, rc)
        if not offloaded:
            return steps, {}
        plan = place(steps, offloaded, loss_step(steps, acts), node_time_of, offload.hw)
        return with_transfers(steps, plan), plan

    first = simulator(schedule(acts, set()))
    offloaded = choose_offloads(acts, ledger, first, budget_bytes, offload, build, simulator, node_time_of)

    def score(root: fx.Node) -> tuple[float, set[fx.Node]] | None:
        members = ledger.members(root)
        if any(m in edges for m in members):
            return None
        chain = ledger.closure(members, edges.__contains__) if members else None
        if not chain:
            return None
        freed = -ledger.delta(chain)
        if freed <= 0:
            return None
        # A gather the chain adds is traffic a real job pays for (no twin to merge with).
        cost = sum(node_time_of(n) for n in chain) + sum(node_time_of(s) for s in acts.new_gathers(chain))
        return freed / max(cost, 1e-12), chain

    heap: list[tuple[float, int, fx.Node]] = []

    def push(root: fx.Node) -> None:
        if root in offloaded:
            return
        found = score(root)
        if found is not None:
            heapq.heappush(heap, (-found[0], acts.pos[root], root))

    def at_peak(root: fx.Node, profile: Profile) -> bool:
        return any(profile.owner.get(n) in profile.alive for n in ledger.members(root))

    for root in list(ledger.held):
        push(root)
    profile = simulator(build(ledger.rc, offloaded)[0])
    cap, misses = float("inf"), 0
    while profile.peak > budget_bytes and heap and misses < MAX_MISSES:
        before, queued = ledger.snapshot(), list(heap)
        target, freed, chosen, later = min(profile.peak - budget_bytes, cap), 0, [], []
        while freed < target and heap:
            _, _, root = heapq.heappop(heap)
            found = score(root)
            if found is None:
                continue
            if heap and found[0] < -heap[0][0]:
                heapq.heappush(heap, (-found[0], acts.pos[root], root))
                continue
            if not at_peak(root, profile):
                later.append(root)
                continue
            held = ledger.bytes
            for new in ledger.apply(found[1]):
                push(acts.roots[new])
            freed += held - ledger.bytes
            chosen.append(root)
        for root in later:
            push(root)
        if not chosen:
            break
        lowered = simulator(build(ledger.rc, offloaded)[0])
        if lowered.peak < profile.peak:
            profile, cap, misses = lowered, float("inf"), 0
            continue
        # Too much at once (the copies in backward outweigh what they free) or the wrong storage:
        # undo, then try half as much, and drop a single candidate that does not help.
        ledger.restore(before)
        heap[:] = queued
        misses += 1
        if len(chosen) == 1:
            heap[:] = [entry for entry in heap if entry[2] is not chosen[0]]
            heapq.heapify(heap)
        cap = freed / 2
    plan = build(ledger.rc, offloaded)[1]
    held = ledger.bytes - sum(acts.root_bytes(r) for r in plan)
    return Policy(ledger.rc, held, baseline, sum(node_time_of(n) for n in ledger.rc), profile.peak, first.peak, plan)


def _block_edges(acts: Activations) -> set[fx.Node]:
    """The activations a block hands to code outside it (the residual stream between blocks)."""
    block_of = acts.block_of
    return {n for n in acts.forward if any(block_of.get(u) != block_of[n] for u in n.users if u in acts.forward)}


def plan_op_policy(acts: Activations, save_ops: set[Any], node_time: Callable[[fx.Node], float],
                   fused: Collection[fx.Node] = frozenset()) -> Policy:
    """torchtitan's op-level SAC, per block (`blocks.node_block`): keep the outputs of
    `save_ops` (of matmuls only the 1st, 3rd, ... of each block, as torchtitan counts them) and the
    values a block hands to other code; recompute every other recomputable op of the blocks."""
    block_of = acts.block_of
    mm_count: dict[Any, int] = {}
    keep = _block_edges(acts)
    for node in acts.order:
        block = block_of.get(node)
        if block is None:
            continue
        if node.target is torch.ops.aten.mm.default:
            mm_count[block] = mm_count.get(block, 0) + 1
            if mm_count[block] % 2:
                keep.add(node)
        elif node.target in save_ops:
            keep.add(node)
    ledger = Ledger(acts)
    baseline = ledger.bytes
    stop = lambda n: block_of.get(n) is None or n in keep  # noqa: E731
    for node in acts.order:
        if block_of.get(node) is not None and node not in keep and ledger.saved(node):
            chain = ledger.closure([node], stop)
            if chain:
                ledger.apply(chain)
    simulator = Simulator(fused)
    peak, first = (simulator(schedule(acts, rc)).peak for rc in (ledger.rc, set()))
    return Policy(ledger.rc, ledger.bytes, baseline, sum(node_time(n) for n in ledger.rc), peak, first)


def state_bytes(ctx: PassContext) -> int:
    """What the step holds besides activations: parameter shards, their gradients, two AdamW moments."""
    return 4 * sum(nbytes(t) for t in ctx.example_inputs[: ctx.num_params])


def persistent_bytes(gm: fx.GraphModule, ctx: PassContext) -> int:
    """What the step holds while its graph runs besides the values the graph makes: the graph's
    inputs (parameter shards, buffers, the batch, and AdamW's state when the update is in the graph),
    AdamW's two moments when it is not, and under gradient accumulation the gradients of the earlier
    microbatches. The graph's own gradients are graph outputs: the simulation counts them."""
    inputs = [nbytes(n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")]
    params = sum(inputs[: ctx.num_params])
    moments = 0 if ctx.cfg.compile.optimizer_in_graph else 2 * params
    accumulated = params if ctx.cfg.training.gradient_accumulation_steps > 1 else 0
    return sum(inputs) + moments + accumulated


def step_peak_bytes(gm: fx.GraphModule, ctx: PassContext) -> int:
    """The simulated peak of the step as `gm` stands after any pass (the collective schedule's buckets and
    prefetched gathers included), with what the step holds besides its values."""
    return persistent_bytes(gm, ctx) + _profile(gm, ctx).peak


def step_budget(ctx: PassContext) -> float:
    """`--activation_checkpoint.memory_budget` in bytes: the most the step may hold at once."""
    memory = select(ctx.cfg.compile.hardware, ctx.device).device_memory_bytes
    return parse_memory_budget(ctx.cfg.activation_checkpoint.memory_budget, memory, flag=BUDGET_FLAG, when_empty=fill_device)


def activation_budget(ctx: PassContext) -> float:
    """aot's share for activations: the step's budget less what it holds besides them."""
    return step_budget(ctx) - state_bytes(ctx)


def compiler_fused(gm: fx.GraphModule, ctx: PassContext) -> set[fx.Node]:
    """The values a whole-graph Inductor compile fuses away (`fusion`): within a block's forward, a
    block's backward, or the code outside the blocks (the loss's forward and backward run together);
    none under a backend that does not compile the whole graph."""
    if ctx.cfg.compile.inductor_compilation not in FUSING_BACKENDS:
        return set()
    order = list(gm.graph.nodes)
    backward = {n for n in order[forward_end(gm) + 1:] if n.op == "call_function"}

    def piece(node: fx.Node) -> Hashable:
        block = node_block(node)
        return None if block is None else (block, node in backward)

    return unmaterialized(order, piece)


def _rewrite(gm: fx.GraphModule, acts: Activations, recompute: set[fx.Node], offload: set[fx.Node], cost: CostModel) -> None:
    recompute_in_backward(gm, acts, recompute)
    if offload:
        offload_in_backward(gm, acts, offload, cost)


class _Sketch(fx.GraphModule):
    """A graph module that is never run: the passes applied to it do not generate its Python code
    (half of their time on an 8B step)."""

    def recompile(self) -> None:
        return None


def _copy(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy of `gm` to rewrite and simulate, whose nodes share the originals' values (meta copied
    shallowly): `gm` stays as it is."""
    graph, copies = fx.Graph(), {}
    for node in gm.graph.nodes:
        copies[node] = graph.node_copy(node, copies.__getitem__)
    copy = _Sketch(gm, graph)
    copy.meta = dict(gm.meta)
    return copy, copies


def _profile(gm: fx.GraphModule, ctx: PassContext) -> Profile:
    """The simulated liveness of `gm`'s values as the graph stands, in its order."""
    return Simulator(compiler_fused(gm, ctx))(graph_schedule(gm.graph.nodes))


def scheduled_peak(gm: fx.GraphModule, policy: Policy, ctx: PassContext, cost: CostModel) -> tuple[int, dict[fx.Node, int]]:
    """The simulated peak of the step's own values with `policy` applied and the backend's later passes run
    (`ctx.later_passes`: the collective schedule's buckets in flight, its prefetched gathers), on a copy;
    and what those passes hold beyond the rewritten graph's values, by node of `gm` (bytes live as
    each op runs, after the passes less before them): the `extra` of the policy's next simulation."""
    copy, copies = _copy(gm)
    _rewrite(copy, Activations.of_step(copy, ctx), {copies[n] for n in policy.recompute}, {copies[n] for n in policy.offload}, cost)
    before = dict(zip(copy.graph.nodes, _profile(copy, ctx).curve))
    quiet = dataclasses.replace(ctx, dumper=None, report={}, later_passes=())
    for name in ctx.later_passes:
        if ctx.stage in PASSES[name].stages:
            copy = PASSES[name].fn(copy, quiet)
    after = _profile(copy, ctx)
    origin = {c: n for n, c in copies.items()}
    extra = {origin[c]: live - before[c] for c, live in zip(copy.graph.nodes, after.curve) if c in before and c in origin}
    return after.peak, extra


def schedule_bound(gm: fx.GraphModule, ctx: PassContext, cost: CostModel) -> int:
    """The most a collective schedule holds beyond the graph's own values: the gathered bytes it lets be in flight
    (`max_in_flight_bytes`), and two reductions of each kind in flight, each at most a block's gradients, a gradient
    outside the blocks (`block_buckets`, the default schedule's) or a size-capped bucket (`max_bucket_bytes`)."""
    buckets = block_buckets(gm, find_collectives(gm), list(ctx.param_fqns[: ctx.num_params]), alone=True)
    largest: dict[str, int] = {}
    for b in buckets:
        if b.kind in REDUCTIONS:
            largest[b.kind] = max(largest.get(b.kind, cost.hw.max_bucket_bytes), b.nbytes)
    return cost.hw.max_in_flight_bytes + 2 * sum(largest.values())


def _budget_policy(gm: fx.GraphModule, acts: Activations, ctx: PassContext, cost: CostModel, budget: float,
                   persistent: int, fused: set[fx.Node]) -> tuple[Policy, int | None]:
    """The budget policy, and the step's scheduled peak with it (None without later passes). The
    policy simulates the graph it rewrites; the collective schedule then holds buffers it does not see
    (a gradient's reduce-scatter in flight through the next block's backward: at 8B the output
    projection's fp32 gradient, 1.96 GiB, put the step's measured peak 1.8 GiB over the policy's, in
    the first blocks' backward). So the policy plans again with what the schedule held as each op ran
    in its simulation (`scheduled_peak`), and so chooses what is live where the step really peaks,
    until the scheduled peak fits (`SCHEDULE_ROUNDS` plans at most, the lowest scheduled peak kept)."""
    offload = Offload(offload_mode(ctx.cfg), cost.hw)
    extra: dict[fx.Node, int] = {}
    best: tuple[int, Policy] | None = None
    for _ in range(SCHEDULE_ROUNDS):
        policy = plan_memory_budget(acts, budget - persistent, cost.node_time, offload, fused, extra)
        # the copies, their schedules and simulations took the pass from 0.24 to 1.8-3.7 s at llama3 8B cut to 16
        # layers (2 H200s' host): not paid where nothing a schedule holds would reach the budget (one that fills the
        # device, most often)
        if not ctx.later_passes or best is None and persistent + policy.peak_bytes + schedule_bound(gm, ctx, cost) <= budget:
            return policy, None
        values, extra = scheduled_peak(gm, policy, ctx, cost)
        peak = persistent + values
        if best is None or peak < best[0]:
            best = (peak, policy)
        if peak <= budget:
            break
    assert best is not None
    return best[1], best[0]


def _train_step(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    name = policy_name(ctx.cfg)
    acts = Activations.of_step(gm, ctx)
    cost = CostModel.for_context(ctx)
    persistent = persistent_bytes(gm, ctx)
    budget = step_budget(ctx) if name == "memory_budget" else None
    fused = compiler_fused(gm, ctx)
    scheduled = None
    if budget is not None:
        policy, scheduled = _budget_policy(gm, acts, ctx, cost, budget, persistent, fused)
    else:
        policy = plan_op_policy(acts, OP_SAC_SAVE_LIST, cost.node_time, fused)
    recomputed = recomputed_bytes(acts, policy.recompute)
    _rewrite(gm, acts, policy.recompute, set(policy.offload), cost)
    report_train_step(ctx, name, policy, recomputed, budget, persistent, scheduled)
    return gm


def _joint(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """aot: the min-cut partitioner decides, under its activation memory budget knob (the share of the
    activations its default partition saves), set from our budget on the joint graph's activations."""
    acts = Activations.of_step(gm, ctx)
    baseline = Ledger(acts).bytes
    budget = activation_budget(ctx)
    share = min(1.0, max(0.0, budget / baseline)) if baseline else 1.0
    first = next(n for n in gm.graph.nodes if n.op == "call_function")
    first.meta[PARTITIONER_BUDGET_META] = share
    report_policy(ctx, 0, 0, step_budget(ctx), ac_baseline_gib=baseline / GiB, ac_partitioner_budget=share,
                  ac_activation_budget_gib=budget / GiB)
    return gm


def _forward(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """aot: what the partitioner chose, read off the forward graph: its outputs after the loss are
    what backward gets; those computed from the batch are the saved activations."""
    acts = Activations.of_step(gm, ctx)
    outputs = next(n for n in reversed(acts.order) if n.op == "output").args[0]
    roots = {acts.roots[n] for n in outputs[1:] if isinstance(n, fx.Node)}
    saved = sum(acts.root_bytes(r) for r in roots)
    report_partition(ctx, saved)
    return gm


def memory_policy(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return {"train_step": _train_step, "joint": _joint, "forward": _forward}[ctx.stage](gm, ctx)


PARTITIONER_BUDGET_META = "memory_budget"
"""node.meta key the min-cut partitioner reads its activation memory budget from (torch's own knob)."""
BUDGET_FLAG = "--activation_checkpoint.memory_budget"

register_pass(PassSpec(
    name="memory_policy",
    description="save or recompute each activation for backward (set by --activation_checkpoint.mode "
                "memory_budget, or selective op in aot_fx_trace)",
    stages=("train_step", "joint", "forward"),
    modes=("aot", "aot_fx_trace"),
    fn=memory_policy,
    set_by="--activation_checkpoint.mode",
))
