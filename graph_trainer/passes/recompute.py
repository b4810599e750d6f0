"""Recomputation for the memory policy (memory_policy.py): the saved set of a recompute set (`Ledger`),
the graph as the rewrite will leave it (`schedule`, for the simulation) and the rewrite itself
(`recompute_in_backward`), both made by one `Rebuild` so the rewrite is what the policy simulated."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import fx

from ..graph_dump import nbytes
from .activations import Activations
from .liveness import Step
from .transfers import Transfer

RECOMPUTED = "recomputed"


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

    rebuild = Rebuild(acts, recompute, emit)
    for step in acts.steps:
        node = step[1]
        rebuild.ran.add(node)
        if node in gone or node in rebuild.merged:
            continue
        if acts.is_backward(node) and any(i in recompute or i in rebuild.merged for i in acts.inputs[node]):
            steps.append((node, node, {i: rebuild(i) for i in acts.inputs[node]}))
        else:
            steps.append(step)
    return _without_feeders(steps, set(rebuild.merged))


def _without_feeders(steps: list[Step], removed: set[fx.Node]) -> list[Step]:
    """`steps` without the ops whose every reader is removed (a merged twin's own cast of its shard), as
    `recompute_in_backward` erases them."""
    kept: list[Step] = []
    for step in reversed(steps):
        node = step[1]
        if step[0] is node and node.op == "call_function" and node.users and all(u in removed for u in node.users):
            removed.add(node)
            continue
        kept.append(step)
    return kept[::-1]


class Rebuild:
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


class Ledger:
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

    rebuild = Rebuild(acts, recompute, emit)
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
        feeders = twin.all_input_nodes
        graph.erase_node(twin)
        # and the ops only the twin read (its own cast of the shard), as `schedule` leaves them out
        while feeders:
            node = feeders.pop()
            if node.op == "call_function" and not node.users and node not in rebuild.merged:
                feeders.extend(node.all_input_nodes)
                graph.erase_node(node)
    # Forward values only backward read are now computed for nothing.
    for node in reversed(acts.order):
        if node in recompute and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def recomputed_bytes(acts: Activations, recompute: set[fx.Node]) -> int:
    """Bytes the recomputation writes again: the storages of recomputed ops that own one."""
    return sum(acts.root_bytes(n) for n in recompute if acts.roots[n] is n)
