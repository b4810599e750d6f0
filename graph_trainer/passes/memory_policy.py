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
  reached. The simulation counts the unfused graph: a backend that fuses ops (Inductor) materializes
  fewer transients, so the measured peak is often lower than the simulated one; passes after this one
  that prefetch gathered parameters (bucketing) can make it higher. In `aot` the
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
"""

from __future__ import annotations

import heapq
import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx

from ..graph_dump import is_collective, nbytes
from ..hardware import Hardware, select
from ..parallel import BLOCK_KEY, OP_SAC_SAVE_LIST
from ..units import GiB, parse_memory_budget
from .collectives import Collective, find_collectives, forward_derived, forward_end
from .cost_model import CostModel
from .liveness import Profile, Simulator, Step, alias_of, graph_schedule, simulate
from .transfers import Transfer, insert_transfers, place, windows, with_transfers
from .registry import PassContext, PassSpec, register_pass

logger = logging.getLogger("graph_trainer")

RECOMPUTED = "recomputed"
MAX_MISSES = 8
"""Rounds in a row that fail to lower the simulated peak before the budget policy gives up."""


def policy_name(cfg: Any) -> str | None:
    """Which policy the config asks of this pass, or None (op-level selective AC in aot is torch's
    own: the partitioner reads the tags torchtitan's wrappers set)."""
    ac = cfg.activation_checkpoint
    if ac.mode == "memory_budget":
        return "memory_budget"
    if ac.mode == "selective" and ac.selective_ac_option == "op" and cfg.compile.mode == "aot_fx_trace":
        return "op"
    return None


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
    return ["memory_policy"] if policy_name(cfg) else []


def _mutates(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def _argument(node: fx.Node, name: str) -> Any:
    """The value of an op's argument by schema name (its default when not passed); None if it has none."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[i] if i < len(node.args) else arg.default_value
    return None


class Activations:
    """What the train-step graph keeps across the loss, and what could be recomputed instead.

    `batch` are the placeholders of the batch (inputs, labels): values that depend on none of them
    are parameter-derived and neither counted nor recomputed."""

    def __init__(self, gm: fx.GraphModule, batch: set[fx.Node]):
        self.order = list(gm.graph.nodes)
        self.pos_of_loss = boundary = forward_end(gm)
        self.pos = {n: i for i, n in enumerate(self.order)}
        depends = set(batch)
        for node in self.order:
            if node.op == "call_function" and any(i in depends for i in node.all_input_nodes):
                depends.add(node)
        self.forward = {n for n in self.order[: boundary + 1] if n.op == "call_function" and n in depends}
        self.roots: dict[fx.Node, fx.Node] = {}
        for node in self.order:
            alias = alias_of(node)
            self.roots[node] = self.roots.get(alias, alias) if alias is not None else node
        self.by_root: dict[fx.Node, list[fx.Node]] = {}
        for node in self.forward:
            self.by_root.setdefault(self.roots[node], []).append(node)
        mutated = {self.roots[n.args[0]] for n in self.order if _mutates(n) and n.args and isinstance(n.args[0], fx.Node)}
        self.recomputable = {n for n in self.forward if self._recomputable(n, mutated)}
        self.offloadable = {n for n in self.forward if self._offloadable(n, mutated)}
        self.gathered, self.twin = _regathered(gm, self.pos, boundary)
        self.inputs = {n: n.all_input_nodes for n in self.order}
        self.steps: list[Step] = [(n, n, {i: i for i in self.inputs[n]}) for n in self.order]
        """The graph as it stands, as a `liveness` schedule."""

    def _recomputable(self, node: fx.Node, mutated: set[fx.Node]) -> bool:
        target = node.target
        if target is operator.getitem:
            return True
        if not isinstance(target, torch._ops.OpOverload) or is_collective(node) or _mutates(node):
            return False
        if torch.Tag.nondeterministic_seeded in target.tags and _argument(node, "dropout_p") != 0:
            return False
        # A storage written in place after `node` read it would give a recomputation other inputs;
        # views read it when used, so recomputing a view sees what the original view saw.
        return target.is_view or not any(self.roots[i] in mutated for i in node.all_input_nodes) and self.roots[node] not in mutated

    def _offloadable(self, node: fx.Node, mutated: set[fx.Node]) -> bool:
        """A storage of its own that backward reads whole: the copy to host and back is then the value,
        and the reload can take over every backward read."""
        val = node.meta.get("val")
        if self.roots[node] is not node or node in mutated or is_collective(node) or not isinstance(val, torch.Tensor):
            return False
        if not val.numel() or not _dense(val):
            return False
        return all(m is node or not any(self.is_backward(u) for u in m.users) for m in self.by_root[node])

    def new_gathers(self, chain: set[fx.Node]) -> set[fx.Node]:
        """The forward all-gathers whose copies recomputing `chain` adds to backward (those backward
        gathers again anyway are merged with their twins)."""
        starts = {self.gathered[i] for n in chain for i in self.inputs[n] if i in self.gathered}
        return {s for s in starts if s not in self.twin}

    def is_backward(self, node: fx.Node) -> bool:
        return node.op == "call_function" and self.pos[node] > self.pos_of_loss

    def root_bytes(self, root: fx.Node) -> int:
        return nbytes(root.meta.get("val")) if root in self.forward else 0


def _regathered(gm: fx.GraphModule, pos: dict[fx.Node, int], boundary: int) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, fx.Node]]:
    """The parameters backward does not read from forward's gather (`reshard_after_forward` gathers
    them again, or backward does not need them): each value of their forward gather (start, wait and
    what forward derives from it alone) mapped to the gather's start; and for the start and wait of
    each, those of the first backward gather of the same shard (its twin).

    A recomputation reading one of these values gathers again rather than keep the forward copy
    alive into backward; where a twin runs later, the rewrite merges the two (the same collective
    on the same shard gives the same value), so backward still gathers each parameter once."""
    gathers = [c for c in find_collectives(gm) if c.kind == "all_gather"]
    later: dict[tuple, Collective] = {}
    for c in gathers:
        if pos[c.start] > boundary:
            later.setdefault(tuple(c.start.args), c)
    gathered: dict[fx.Node, fx.Node] = {}
    twin: dict[fx.Node, fx.Node] = {}
    for c in gathers:
        if pos[c.start] > boundary:
            continue
        values = [c.start, c.wait, *forward_derived(c.wait, pos, boundary)]
        if any(pos[u] > boundary for v in values[1:] for u in v.users):
            continue
        gathered.update((v, c.start) for v in values)
        if (b := later.get(tuple(c.start.args))) is not None:
            twin[c.start], twin[c.wait] = b.start, b.wait
    return gathered, twin


def _dense(t: torch.Tensor) -> bool:
    """No two elements share memory and none is skipped (a copy with the same strides is a plain copy)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True


@dataclass
class Policy:
    recompute: set[fx.Node]
    saved_bytes: int
    """Bytes of activations held on the device across the loss (offloaded ones not counted)."""
    baseline_bytes: int
    recompute_s: float
    peak_bytes: int = 0
    """Simulated peak of the graph's own values with the policy (`liveness`; graph inputs excluded)."""
    baseline_peak_bytes: int = 0
    """The same without recomputation or offload."""
    offload: dict[fx.Node, Transfer] = field(default_factory=dict)
    """The offloaded activations and their transfers, at positions of the schedule the policy simulated."""

    @property
    def offloaded_bytes(self) -> int:
        return sum(nbytes(r.meta.get("val")) for r in self.offload)

    @property
    def unhidden(self) -> int:
        """Offloaded activations whose transfers compute does not hide (only under `always`)."""
        return sum(1 for t in self.offload.values() if t.exposed_s > 0)


@dataclass(frozen=True)
class Offload:
    """What the budget policy may offload (`--activation_checkpoint.offload`) and the link it prices."""

    mode: str
    """never | auto | always"""
    hw: Hardware


NEVER = Offload("never", Hardware())


def schedule(acts: Activations, recompute: set[fx.Node]) -> list[Step]:
    """The graph as `recompute_in_backward` will leave it, without rewriting it: recomputed copies
    (keyed `(RECOMPUTED, node)`) just before their first backward reader, with the gathers of the
    parameters they read (`Activations.gathered`: the twin's values where it ran already, else a
    copy that takes the twin's place); forward values nothing reads any more left out."""
    gone: set[fx.Node] = set()
    for node in reversed(acts.order):
        if node in recompute and all(acts.is_backward(u) or u in gone for u in node.users):
            gone.add(node)
    steps: list[Step] = []

    def emit(node: fx.Node, copies: dict[fx.Node, Any]) -> Any:
        key = (RECOMPUTED, node)
        steps.append((key, node, {i: copies.get(i, i) for i in acts.inputs[node]}))
        return key

    rebuild = _Rebuild(acts, recompute, emit)
    for step in acts.steps:
        node = step[1]
        rebuild.ran.add(node)
        if node in gone or node in rebuild.merged:
            continue
        if acts.is_backward(node) and any(i in recompute or i in rebuild.merged for i in acts.inputs[node]):
            steps.append((node, node, {i: rebuild(i) for i in acts.inputs[node]}))
        else:
            steps.append(step)
    return steps


class _Rebuild:
    """The copy a backward read of a recomputed value takes, made once by `emit(node, copies)` (and shared
    by later reads) after those of its inputs: the recomputed chain, and the gather of each parameter it
    reads (`Activations.gathered`), which is the twin's where that ran already and otherwise takes the
    twin's place (`merged`: twin -> copy). `schedule` and `recompute_in_backward` share it, so the
    rewrite is what the policy simulated; their loops add each node of the graph to `ran` as they pass it."""

    def __init__(self, acts: Activations, recompute: set[fx.Node], emit: Callable[[fx.Node, dict], Any]):
        self.acts, self.recompute, self.emit = acts, recompute, emit
        self.copies: dict[fx.Node, Any] = {}
        self.ran: set[fx.Node] = set()
        self.merged: dict[fx.Node, Any] = {}

    def __call__(self, node: fx.Node) -> Any:
        if node not in self.recompute and node not in self.acts.gathered:
            return self.merged.get(node, node)
        if node not in self.copies:
            twin = self.acts.twin.get(node)
            if twin in self.ran:
                self.copies[node] = twin
                return twin
            for i in self.acts.inputs[node]:
                self(i)
            self.copies[node] = self.emit(node, self.copies)
            if twin is not None:
                self.merged[twin] = self.copies[node]
        return self.copies[node]


class _Ledger:
    """The saved set of a recompute set, kept incrementally: a forward value is saved when it is not
    recomputed and a backward op or a recomputed op reads it; a storage is held while any value in it
    is saved."""

    def __init__(self, acts: Activations):
        self.acts = acts
        self.rc: set[fx.Node] = set()
        boundary = acts.pos_of_loss
        self.readers = {n: sum(1 for u in n.users if acts.pos[u] > boundary and u.op == "call_function") for n in acts.forward}
        self.held: dict[fx.Node, int] = {}
        for n, count in self.readers.items():
            if count:
                self.held[acts.roots[n]] = self.held.get(acts.roots[n], 0) + 1
        self.bytes = sum(acts.root_bytes(r) for r in self.held)

    def saved(self, node: fx.Node) -> bool:
        return node in self.readers and node not in self.rc and self.readers[node] > 0

    def closure(self, starts: list[fx.Node], stop: Callable[[fx.Node], bool]) -> set[fx.Node] | None:
        """The values to recompute to rebuild `starts`, going back until saved values, parameters or
        values `stop` keeps; None when a start cannot be recomputed."""
        if any(n not in self.acts.recomputable for n in starts):
            return None
        todo, chain = list(starts), set()
        while todo:
            node = todo.pop()
            if node in chain or node in self.rc:
                continue
            chain.add(node)
            for i in node.all_input_nodes:
                # An intermediate that cannot be recomputed is saved instead (`delta` counts it).
                if i in self.acts.recomputable and i not in self.rc and not self.saved(i) and not stop(i):
                    todo.append(i)
        return chain

    def delta(self, chain: set[fx.Node]) -> int:
        """Change in held bytes if `chain` were recomputed."""
        change: dict[fx.Node, int] = {}
        for node in chain:
            if self.saved(node):
                change[self.acts.roots[node]] = change.get(self.acts.roots[node], 0) - 1
            for i in node.all_input_nodes:
                if i in self.acts.forward and i not in chain and i not in self.rc and not self.saved(i):
                    change[self.acts.roots[i]] = change.get(self.acts.roots[i], 0) + 1
        total = 0
        for root, d in change.items():
            before = self.held.get(root, 0)
            if before == 0 and d > 0:
                total += self.acts.root_bytes(root)
            elif before > 0 and before + d <= 0:
                total -= self.acts.root_bytes(root)
        return total

    def apply(self, chain: set[fx.Node]) -> list[fx.Node]:
        """Recompute `chain`; returns the values that became saved."""
        newly = []
        for node in chain:
            if self.saved(node):
                self._release(node)
        self.rc |= chain
        for node in chain:
            for i in node.all_input_nodes:
                if i in self.readers and i not in self.rc:
                    if self.readers[i] == 0:
                        root = self.acts.roots[i]
                        if self.held.get(root, 0) == 0:
                            self.bytes += self.acts.root_bytes(root)
                        self.held[root] = self.held.get(root, 0) + 1
                        newly.append(i)
                    self.readers[i] += 1
        return newly

    def snapshot(self) -> tuple:
        return set(self.rc), dict(self.readers), dict(self.held), self.bytes

    def restore(self, state: tuple) -> None:
        rc, readers, held, self.bytes = state
        self.rc, self.readers, self.held = set(rc), dict(readers), dict(held)

    def _release(self, node: fx.Node) -> None:
        root = self.acts.roots[node]
        self.held[root] -= 1
        if self.held[root] == 0:
            self.bytes -= self.acts.root_bytes(root)

    def members(self, root: fx.Node) -> list[fx.Node]:
        return [n for n in self.acts.by_root.get(root, ()) if self.saved(n)]


def _loss_step(steps: list[Step], acts: Activations) -> int:
    """The index in `steps` of the last forward step: forward and backward meet there. (The loss itself
    may be gone: a loss only backward reads can be recomputed there.)"""
    boundary = -1
    for i, (key, node, _) in enumerate(steps):
        if key is node and acts.pos.get(node, len(acts.order)) <= acts.pos_of_loss:
            boundary = i
    return boundary


def plan_memory_budget(acts: Activations, budget_bytes: float, node_time: Callable[[fx.Node], float],
                       offload: Offload = NEVER) -> Policy:
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
    `MAX_MISSES` such rounds in a row end the search."""
    ledger = _Ledger(acts)
    baseline = ledger.bytes
    # A chain that crossed blocks would rebuild earlier blocks' values at the first backward read and hold
    # them until their own block's backward (through every block, the whole forward at once): the values
    # a block hands on are saved, so each recomputation is one block's ops from its saved inputs.
    edges = _block_edges(acts, _blocks(acts))
    simulator = Simulator()
    times: dict[fx.Node, float] = {}

    def node_time_of(node: fx.Node) -> float:
        if node not in times:
            times[node] = node_time(node)
        return times[node]

    def build(rc: set[fx.Node], offloaded: set[fx.Node]) -> tuple[list[Step], dict[fx.Node, Transfer]]:
        steps = schedule(acts, rc)
        if not offloaded:
            return steps, {}
        plan = place(steps, offloaded, _loss_step(steps, acts), node_time_of, offload.hw)
        return with_transfers(steps, plan), plan

    first = simulator(schedule(acts, set()))
    offloaded = _choose_offloads(acts, ledger, first, budget_bytes, offload, build, simulator, node_time_of)

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


def _choose_offloads(acts: Activations, ledger: _Ledger, profile: Profile, budget_bytes: float, offload: Offload,
                     build: Callable, simulator: Simulator, node_time: Callable[[fx.Node], float]) -> set[fx.Node]:
    """The activations `plan_memory_budget` offloads (see there), before any recomputation."""
    if offload.mode == "never" or not acts.offloadable:
        return set()
    steps = schedule(acts, set())
    spans = windows(steps, _loss_step(steps, acts))
    candidates = [r for r in acts.offloadable if r in spans and spans[r][0] + 1 < spans[r][1]]
    if offload.mode == "always":
        return set(candidates)
    if offload.hw.host_link_bytes_per_s <= 0:
        return set()

    def recompute_s(root: fx.Node) -> float:
        chain = ledger.closure([root], lambda n: False) if root in acts.recomputable else None
        return float("inf") if chain is None else sum(node_time(n) for n in chain)

    costs = {r: recompute_s(r) for r in candidates}
    # The copies' launches are host work like any kernel's: where recomputing costs less, recompute.
    dear = [r for r in candidates if costs[r] > OFFLOAD_LAUNCHES * offload.hw.launch_s]
    chosen: set[fx.Node] = set()
    left = sorted(dear, key=lambda r: (-costs[r] / max(acts.root_bytes(r), 1), acts.pos[r]))
    # The peak moves as activations leave it: sweep again over those not live at it before, until a
    # sweep adds nothing.
    progress = True
    while progress and profile.peak > budget_bytes:
        progress, skipped = False, []
        for root in left:
            if profile.peak <= budget_bytes or root not in profile.alive:
                skipped.append(root)
                continue
            trial = chosen | {root}
            trial_steps, plan = build(set(), trial)
            if any(t.exposed_s > 0 for t in plan.values()):
                continue
            lowered = simulator(trial_steps)
            if lowered.peak < profile.peak:
                chosen, profile, progress = trial, lowered, True
        left = skipped
    return chosen


def _blocks(acts: Activations) -> dict[fx.Node, Any]:
    """The transformer block each forward activation was computed in (`BLOCK_KEY`; None outside blocks)."""
    return {n: n.meta.get("custom", {}).get(BLOCK_KEY) for n in acts.forward}


def _block_edges(acts: Activations, block_of: dict[fx.Node, Any]) -> set[fx.Node]:
    """The activations a block hands to code outside it (the residual stream between blocks)."""
    return {n for n in acts.forward if any(block_of.get(u) != block_of[n] for u in n.users if u in acts.forward)}


def plan_op_policy(acts: Activations, save_ops: set[Any], node_time: Callable[[fx.Node], float]) -> Policy:
    """torchtitan's op-level SAC, per block (`node.meta["custom"]["ac_block"]`): keep the outputs of
    `save_ops` (of matmuls only the 1st, 3rd, ... of each block, as torchtitan counts them) and the
    values a block hands to other code; recompute every other recomputable op of the blocks."""
    block_of = _blocks(acts)
    mm_count: dict[Any, int] = {}
    keep = _block_edges(acts, block_of)
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
    ledger = _Ledger(acts)
    baseline = ledger.bytes
    stop = lambda n: block_of.get(n) is None or n in keep  # noqa: E731
    for node in acts.order:
        if block_of.get(node) is not None and node not in keep and ledger.saved(node):
            chain = ledger.closure([node], stop)
            if chain:
                ledger.apply(chain)
    peak, first = (simulate(schedule(acts, rc)).peak for rc in (ledger.rc, set()))
    return Policy(ledger.rc, ledger.bytes, baseline, sum(node_time(n) for n in ledger.rc), peak, first)


def recompute_in_backward(gm: fx.GraphModule, acts: Activations, recompute: set[fx.Node]) -> fx.GraphModule:
    """Point every backward read of a recomputed value at a copy of its chain, emitted just before
    the first backward op that needs it (and shared by later ones); a parameter the chain reads is
    gathered again there, or read from its backward gather where that ran already (`schedule`)."""
    graph = gm.graph

    def emit(node: fx.Node, copies: dict[fx.Node, fx.Node]) -> fx.Node:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: copies.get(n, n))
        new = graph.create_node("call_function", node.target, args, kwargs, name=f"recompute_{node.name}")
        new.meta = {**node.meta, "memory_policy": RECOMPUTED}
        return new

    rebuild = _Rebuild(acts, recompute, emit)
    for node in list(graph.nodes):
        rebuild.ran.add(node)
        if not acts.is_backward(node):
            continue
        wanted = [i for i in node.all_input_nodes if i in recompute]
        if not wanted:
            continue
        with graph.inserting_before(node):
            for i in wanted:
                node.replace_input_with(i, rebuild(i))
    # The twins' readers come after the copies that replace them (waits before their starts).
    for twin in sorted(rebuild.merged, key=acts.pos.__getitem__, reverse=True):
        twin.replace_all_uses_with(rebuild.merged[twin])
        graph.erase_node(twin)
    # Forward values only backward read are now computed for nothing.
    for node in reversed(acts.order):
        if node in recompute and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def offload_in_backward(gm: fx.GraphModule, acts: Activations, roots: set[fx.Node], cost: CostModel) -> fx.GraphModule:
    """Put the transfers of `roots` into the graph (already rewritten for recomputation): placed on
    the graph's own order, which is the schedule the policy simulated, so they land where it put them."""
    steps = graph_schedule(gm.graph.nodes)
    plan = place(steps, roots, _loss_step(steps, acts), cost.node_time, cost.hw)
    return insert_transfers(gm, plan)


def recomputed_bytes(acts: Activations, recompute: set[fx.Node]) -> int:
    """Bytes the recomputation writes again: the storages of recomputed ops that own one."""
    return sum(acts.root_bytes(n) for n in recompute if acts.roots[n] is n)


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


def step_budget(ctx: PassContext) -> float:
    """`--activation_checkpoint.memory_budget` in bytes: the most the step may hold at once."""
    memory = select(ctx.cfg.compile.hardware, ctx.device).device_memory_bytes
    return parse_memory_budget(ctx.cfg.activation_checkpoint.memory_budget, memory, flag=BUDGET_FLAG)


def activation_budget(ctx: PassContext) -> float:
    """aot's share for activations: the step's budget less what it holds besides them."""
    return step_budget(ctx) - state_bytes(ctx)


def _batch_placeholders(gm: fx.GraphModule, ctx: PassContext) -> set[fx.Node]:
    """The inputs and labels: the two graph inputs after the parameters and buffers."""
    first = ctx.num_params + ctx.num_buffers
    return set(gm.graph.find_nodes(op="placeholder")[first : first + 2])


def _log(name: str, saved: int, baseline: int, recomputed: int, extra: str, tail: str, offloaded: str = "0 GiB") -> None:
    logger.info(
        f"memory policy {name}: activations saved {saved / GiB:.3f} GiB of {baseline / GiB:.3f}, recomputed "
        f"{recomputed / GiB:.3f} GiB{extra}, offloaded {offloaded}; {tail}"
    )


def _report(ctx: PassContext, saved: int, recomputed: int, budget: float | None, offloaded: int = 0,
            **more: float) -> None:
    report = {"ac_saved_gib": saved / GiB, "ac_recomputed_gib": recomputed / GiB, "ac_offloaded_gib": offloaded / GiB,
              **more}
    if budget is not None:
        report["ac_budget_gib"] = budget / GiB
    ctx.report.setdefault("memory_policy", {}).update(report)


def _train_step(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    name = policy_name(ctx.cfg)
    acts = Activations(gm, _batch_placeholders(gm, ctx))
    cost = CostModel.for_context(ctx)
    persistent = persistent_bytes(gm, ctx)
    budget = step_budget(ctx) if name == "memory_budget" else None
    if budget is not None:
        policy = plan_memory_budget(acts, budget - persistent, cost.node_time, Offload(offload_mode(ctx.cfg), cost.hw))
    else:
        policy = plan_op_policy(acts, OP_SAC_SAVE_LIST, cost.node_time)
    recomputed = recomputed_bytes(acts, policy.recompute)
    recompute_in_backward(gm, acts, policy.recompute)
    if policy.offload:
        offload_in_backward(gm, acts, set(policy.offload), cost)
    peak, without = persistent + policy.peak_bytes, persistent + policy.baseline_peak_bytes
    _report(ctx, policy.saved_bytes, recomputed, budget, policy.offloaded_bytes,
            ac_baseline_gib=policy.baseline_bytes / GiB, ac_recompute_s=policy.recompute_s,
            ac_offload_unhidden=policy.unhidden, ac_peak_gib=peak / GiB, ac_peak_baseline_gib=without / GiB,
            ac_persistent_gib=persistent / GiB)
    _log(name, policy.saved_bytes, policy.baseline_bytes, recomputed, f" (est. {policy.recompute_s * 1e3:.1f} ms)",
         f"simulated peak {peak / GiB:.3f} GiB ({without / GiB:.3f} without recomputation or offload, {persistent / GiB:.3f} "
         "of it parameters, optimizer state and inputs)" + ("" if budget is None else f", budget {budget / GiB:.3f} GiB"),
         f"{policy.offloaded_bytes / GiB:.3f} GiB ({len(policy.offload)} activations, {policy.unhidden} of them with "
         "transfers compute does not hide)")
    if budget is not None and peak > budget:
        logger.warning(f"memory policy memory_budget: the budget of {budget / GiB:.3f} GiB cannot be met: recomputing all "
                       f"that lowers the simulated peak leaves {peak / GiB:.3f} GiB")
    return gm


def _joint(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """aot: the min-cut partitioner decides, under its activation memory budget knob (the share of the
    activations its default partition saves), set from our budget on the joint graph's activations."""
    acts = Activations(gm, _batch_placeholders(gm, ctx))
    baseline = _Ledger(acts).bytes
    budget = activation_budget(ctx)
    share = min(1.0, max(0.0, budget / baseline)) if baseline else 1.0
    first = next(n for n in gm.graph.nodes if n.op == "call_function")
    first.meta[PARTITIONER_BUDGET_META] = share
    _report(ctx, 0, 0, step_budget(ctx), ac_baseline_gib=baseline / GiB, ac_partitioner_budget=share,
            ac_activation_budget_gib=budget / GiB)
    return gm


def _forward(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """aot: what the partitioner chose, read off the forward graph: its outputs after the loss are
    what backward gets; those computed from the batch are the saved activations."""
    acts = Activations(gm, _batch_placeholders(gm, ctx))
    outputs = next(n for n in reversed(acts.order) if n.op == "output").args[0]
    roots = {acts.roots[n] for n in outputs[1:] if isinstance(n, fx.Node)}
    saved = sum(acts.root_bytes(r) for r in roots)
    report = ctx.report.get("memory_policy", {})
    baseline = int(report.get("ac_baseline_gib", 0) * GiB)
    budget = report.get("ac_budget_gib")
    activations = report.get("ac_activation_budget_gib")
    _report(ctx, saved, max(0, baseline - saved), None if budget is None else budget * GiB)
    tail = "" if activations is None else f"activation budget {activations:.3f} GiB" + (
        " (over it: nothing more can be recomputed)" if saved > activations * GiB else "")
    _log("memory_budget", saved, baseline, max(0, baseline - saved),
         f" (min-cut partitioner at budget share {report.get('ac_partitioner_budget', 1.0):.2f})", tail)
    return gm


def memory_policy(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return {"train_step": _train_step, "joint": _joint, "forward": _forward}[ctx.stage](gm, ctx)


OFFLOAD_LAUNCHES = 2
"""Kernel launches an offload adds (its two copies; the waits only order streams)."""
OFFLOAD_BACKENDS = ("none", "regional")
"""Backends that run the step graph's ops (outside compiled regions) in the graph's order."""
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
