"""Peak memory of a graph by liveness simulation, in execution order.

A value's storage is allocated by the op that produces it and freed after the last op reading it or
any view of it; views, in-place ops and collective waits share the storage they act on, and each
output of a multi-output op is a storage of its own (what it leaves unread dies with the op). While
an op runs, its inputs and its outputs are live together. Graph inputs are the caller's (counted by
whoever knows what they are: parameters, optimizer state); graph outputs live to the end.

The schedule may differ from the graph's order (a pass can simulate a rewrite before doing it): each
step names the value it produces (a key), the node whose op it runs and the key each input is read as.
A step without a node only reads (a wait that holds its inputs until a transfer is done). The host
copy an offload makes is not device memory: it counts nothing. A collective reads its inputs until its
wait (NCCL works on them while the graph goes on): they live to the wait's step, which the collective
schedule can put blocks after the issue (a gradient bucket in flight through the next block's backward).

A compiler that fuses (`fusion.unmaterialized`, under a whole-graph Inductor compile) never writes
some values: the simulation gives those no storage, and a read of one reads what it was made from
(the fused kernel reads its producer's inputs), so those live until the fused value's last reader.

What a later pass will hold that the schedule does not show (the collective schedule's buckets in
flight) can be added as `extra` bytes by step key: from a step with a figure on, until the next one.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Collection, Hashable, Iterable, Mapping, Sequence

import torch
from torch import fx

from ..graph_dump import is_collective, nbytes
from .bucketing_compat import WAIT
from .offload_ops import OFFLOAD

Step = tuple[Hashable, fx.Node | None, Mapping[fx.Node, Hashable]]
"""(key of the value produced, the node whose op produces it or None, key read for each input node)."""


def alias_of(node: fx.Node) -> fx.Node | None:
    """The node whose storage `node`'s value lives in: views, in-place ops, collective waits, tuple items."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        return node.args[0]
    target = node.target
    if target is WAIT or isinstance(target, torch._ops.OpOverload) and (target.is_view or target._schema.is_mutable):
        first = node.args[0] if node.args else None
        return first if isinstance(first, fx.Node) else None
    return None


def _owns_item(node: fx.Node) -> bool:
    """A tuple item of an op that allocated its outputs (not views of, or writes into, its inputs)."""
    return node.target is operator.getitem and node.args[0].op == "call_function" and alias_of(node.args[0]) is None


def allocated_bytes(node: fx.Node) -> int:
    """Bytes `node`'s op allocates for the value the simulation keys by it: 0 for aliases; of a
    multi-output op, the outputs no item reader takes over."""
    if node.op != "call_function" or node.target is OFFLOAD or alias_of(node) is not None and not _owns_item(node):
        return 0
    total = nbytes(node.meta.get("val"))
    if isinstance(node.meta.get("val"), (list, tuple)):
        total -= sum(nbytes(u.meta.get("val")) for u in node.users if u.target is operator.getitem)
    return max(total, 0)


@dataclass
class Profile:
    peak: int
    """Most bytes of graph-made values live at once."""
    at: int
    """Index in the schedule of the (first) step where the peak is reached."""
    owner: dict[Hashable, Hashable | None]
    """The storage each value lives in (None: a graph input)."""
    alive: set[Hashable]
    """The storages live at the peak."""
    curve: list[int]
    """Bytes live at each step of the schedule (`extra` included)."""


class Simulator:
    """Simulates schedules over one graph's nodes, remembering what each node's op allocates and
    aliases (a pass comparing many schedules of one graph pays for those once); `fused`: the nodes
    whose values are never written (their copies in a schedule too); `extra`: bytes held besides the
    schedule's values from the step of each key on (see the module's docstring)."""

    def __init__(self, fused: Collection[fx.Node] = frozenset(), extra: Mapping[Hashable, int] | None = None) -> None:
        self._shares: dict[fx.Node, fx.Node | None] = {}
        self._bytes: dict[fx.Node, int] = {}
        self._issues: dict[fx.Node, bool] = {}
        self.fused = fused
        self.extra = extra or {}

    def _shared(self, node: fx.Node) -> fx.Node | None:
        """The input whose storage `node`'s value lives in; None when it has its own."""
        if node not in self._shares:
            alias = alias_of(node)
            self._shares[node] = None if alias is None or _owns_item(node) else alias
            self._bytes[node] = allocated_bytes(node)
            self._issues[node] = node.target is not WAIT and is_collective(node)
        return self._shares[node]

    def __call__(self, schedule: Sequence[Step]) -> Profile:
        owner: dict[Hashable, Hashable | None] = {}
        size: dict[Hashable, int] = {}
        born: dict[Hashable, int] = {}
        last: dict[Hashable, int] = {}
        # the storages a read of an unwritten (fused) value reads instead
        through: dict[Hashable, frozenset] = {}
        # an issued collective's output -> the storages of its inputs, read until its wait
        in_flight: dict[Hashable, frozenset] = {}

        def storages(read: Hashable) -> Iterable[Hashable]:
            if read in through:
                return through[read]
            return () if owner[read] is None else (owner[read],)

        end = len(schedule)
        for i, (key, node, inputs) in enumerate(schedule):
            if node is None:
                for read in inputs.values():
                    for storage in storages(read):
                        last[storage] = i
                continue
            if node.op in ("placeholder", "get_attr"):
                owner[key] = None
                continue
            reader_end = end if node.op == "output" else i
            for read in inputs.values():
                for storage in storages(read):
                    last[storage] = reader_end
            if node.op == "output":
                continue
            shared = self._shared(node)
            if self._issues[node]:
                in_flight[key] = frozenset(s for read in inputs.values() for s in storages(read))
            elif node.target is WAIT:
                for storage in in_flight.pop(inputs.get(node.args[0]), ()):
                    last[storage] = i
            if node in self.fused:
                owner[key] = None
                through[key] = frozenset(s for read in inputs.values() for s in storages(read))
            elif shared is not None:
                owner[key] = owner[inputs[shared]]
                if inputs[shared] in through:
                    through[key] = through[inputs[shared]]
            else:
                owner[key] = key
                size[key] = self._bytes[node]
                born[key] = last[key] = i
        change = [0] * (end + 2)
        for storage, bytes_ in size.items():
            change[born[storage]] += bytes_
            change[last[storage] + 1] -= bytes_
        live = peak = at = held = 0
        curve = []
        for i in range(end + 1):
            live += change[i]
            if i < end:
                held = self.extra.get(schedule[i][0], held)
            curve.append(live + held)
            if curve[-1] > peak:
                peak, at = curve[-1], i
        alive = {s for s in size if born[s] <= at <= last[s] and size[s]}
        return Profile(peak, at, owner, alive, curve)


def simulate(schedule: Sequence[Step]) -> Profile:
    return Simulator()(schedule)


def graph_schedule(nodes: Iterable[fx.Node]) -> list[Step]:
    """The graph as it stands: each node produces itself and reads its inputs."""
    return [(n, n, {i: i for i in n.all_input_nodes}) for n in nodes]
