"""Block reuse for the whole-graph Inductor compile: each distinct piece of the train step is compiled
once and called for every block it stands for.

The train-step graph, after every graph pass (so the collectives' schedule is final), is cut by
position where each block's forward and each block's backward begins (`blocks.block_starts`; in a
forward or backward graph that AOTAutograd partitioned, where each block begins in it), and
around each run of communication (collectives, their waits, the bucket copies made from the
parameters and the splits of a gathered bucket). Nothing moves: the pieces run in graph order, so
every collective is issued and waited where the scheduling passes put it. A collective issued in one
piece and waited in a later one (the next block's prefetched all-gather) leaves its piece un-waited,
and the later piece's `wait_tensor` finds the work by that tensor, as it would inside one graph.

Pieces of the same structure (ops, arguments, the shapes, strides and dtypes of every value, inputs
and outputs in the same order) are compiled once, by the same Inductor path as the whole graph. What
differs from block to block is communication: the first blocks' parameters are gathered by the
prologue, the last ones prefetch nothing, the loss's parameters come between. Cut out, it leaves the
compute of every block's forward one piece and of every block's backward one (or two, where backward
starts a weight gradient before its parameters arrive), the same from the first block to the last;
the communication pieces that differ are small. On CPU (llama3 debugmodel, 12 layers, dp_shard 2,
resharded parameters, per-block buckets) that took the full compile from 140 s (10 distinct pieces,
cut at block starts only) to 72 s (22 distinct pieces, most of them communication), the
decomposition from 7.4 s to 1.0 s.

Inductor's decomposition before the compile is done the same way (`decompose_pieces`): each distinct
piece is decomposed once, and the full compile gets the decomposed pieces with the graph (`PIECES`); a
piece whose compile the job's cache holds is not decomposed (passes/inductor.py, `PieceEntry`).

Memory: a value is held between pieces only until the piece that reads it last starts; that piece
gets it in a list it clears (the boxed convention of Inductor's compiled code), so the compiled code
frees it at its last use, where the whole-graph compile frees it. The one exception: the input of a
collective waited in a later piece is held until that piece returns (the whole graph frees it at the
wait), since the collective reads it until then.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import fx

from ..blocks import BlockStart, Phase, block_starts, communication_nodes, computed_from_inputs, update_starts
from ..flops import FLEX_ATTENTION_OPS
from ..graph_dump import is_collective
from .bucketing_compat import WAIT, is_gradient_reduction
from .collectives import read_by_update
from .compat import LazyGraphModule, copy_node_as
from .registry import Compiled, PassContext


class _Ref:
    """A value of a piece by its position, in the structure key."""

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"%{self.index}"


def _describe(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.stride(), val.dtype, val.device.type)
    if isinstance(val, (list, tuple)):
        return tuple(_describe(v) for v in val)
    return repr(val)


@dataclass
class PieceSource:
    """Where a piece comes from in the step's graph: the values it reads (subgraphs, then inputs), its ops in
    graph order and the ones it hands on. Its graph module is copied from them only when asked for: a step
    holds a few distinct pieces among hundreds (llama3 8B: 12 of 201), and copying every op of every piece
    was most of the time cutting the step took."""

    gm: fx.GraphModule
    subgraphs: list[fx.Node]
    inputs: list[fx.Node]
    ops: list[fx.Node]
    outputs: list[fx.Node]

    def structure(self) -> str:
        """What must match for two pieces to share one compiled callable: every op's target and arguments
        (values by position), and the shape, stride and dtype of every value read or made."""
        index: dict[fx.Node, int] = {}
        lines = []
        for node in self.subgraphs:
            index[node] = len(index)
            attr = getattr(self.gm, node.target)
            lines.append(attr.code if isinstance(attr, fx.GraphModule) else f"{type(attr).__name__}@{id(attr)}")
        for node in self.inputs:
            index[node] = len(index)
            lines.append(repr(_describe(node.meta["val"])))
        for node in self.ops:
            index[node] = len(index)
            args = fx.node.map_arg((node.args, node.kwargs), lambda a: _Ref(index[a]))
            lines.append(repr((node.op, str(node.target), args, _describe(node.meta.get("val")))))
        lines.append(repr([index[n] for n in self.outputs]))
        return "\n".join(lines)

    def nodes(self) -> list[fx.Node]:
        """Its nodes of the step's graph in the order its module holds their copies (the output left out): a
        position in one piece's module names the same op in every piece of its group."""
        return [*self.subgraphs, *self.inputs, *self.ops]

    def module(self) -> fx.GraphModule:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {a: graph.get_attr(a.target) for a in self.subgraphs}
        for a in self.inputs:
            env[a] = graph.placeholder(a.name)
            env[a].meta["val"] = a.meta["val"]
        for n in self.ops:
            env[n] = graph.node_copy(n, env.__getitem__)
        graph.output(tuple(env[n] for n in self.outputs))
        return LazyGraphModule(self.gm, graph)


@dataclass
class Piece:
    source: PieceSource
    inputs: list[int]
    """Slots of the values it reads, in the order of its placeholders."""
    outputs: list[int]
    """Slots its outputs go to."""
    frees: list[int]
    """Slots no later piece reads: dropped by the driver before this piece runs."""
    releases: list[int]
    """Inputs of collectives this piece waits for, issued by an earlier piece: dropped after it runs."""
    communication: bool = False
    """Every op of it is of a communication run (`_communication_runs`)."""
    builds_masks: bool = False
    """Every op of it builds FlexAttention's masks (`flex_attention_masks`)."""
    built: fx.GraphModule | None = None
    """Its graph module: copied from its source when first asked for, or its group's decomposition."""

    @property
    def module(self) -> fx.GraphModule:
        if self.built is None:
            self.built = self.source.module()
        return self.built


def _is_constant(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "get_attr" and isinstance(getattr(gm, node.target), torch.Tensor)


def is_subgraph(gm: fx.GraphModule, node: fx.Node) -> bool:
    """An attribute the graph reads that is no tensor: a subgraph a higher-order op calls (FlexAttention's
    score and mask functions)."""
    return node.op == "get_attr" and not _is_constant(gm, node)


def _is_integer_tensor(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and not val.is_floating_point() and not val.is_complex()


def flex_attention_masks(gm: fx.GraphModule) -> set[fx.Node]:
    """The ops that build FlexAttention's block masks (and their mask functions' buffers) from the graph's integer
    inputs, the token ids, alone: every op computed only from those that a FlexAttention op reads, and the ops
    they are computed from."""
    hops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in FLEX_ATTENTION_OPS]
    if not hops:
        return set()
    from_tokens: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            from_tokens[node] = _is_integer_tensor(node.meta.get("val"))
        elif node.op == "call_function":
            from_tokens[node] = all(from_tokens[a] for a in node.all_input_nodes)
        else:
            from_tokens[node] = False
    masks: set[fx.Node] = set()
    todo = [a for n in hops for a in n.all_input_nodes if a.op == "call_function" and from_tokens[a]]
    while todo:
        node = todo.pop()
        if node not in masks and node.op == "call_function":
            masks.add(node)
            todo.extend(node.all_input_nodes)
    return masks


def unread_ops(gm: fx.GraphModule) -> set[fx.Node]:
    """Ops whose results nothing reads, directly or through other such ops, and that change nothing (no mutation,
    no random numbers, no collective). Traces leave some: DTensor's norm of the in-graph optimizer's gradients
    (`clipping.total_norm`, where the traced norm goes through DTensor: tensor or expert parallelism) leaves a
    `_foreach_norm` of empty tensors of the parameters' global shapes (291 for llama3 8B), `create_block_mask` a
    few ops between FlexAttention's masks. Inductor drops them from what it
    compiles, and a piece of them alone compiled to nothing that could be stored: every start of the 8B with the
    in-graph optimizer decomposed and compiled it again (bench/results/2026-11-29-session18)."""
    unread: set[fx.Node] = set()
    for node in reversed(list(gm.graph.nodes)):
        if (node.op == "call_function" and all(u in unread for u in node.users) and not node.is_impure()
                and not is_collective(node)):
            unread.add(node)
    return unread


def _waits(collective: fx.Node) -> list[fx.Node]:
    """The waits of a collective's result (through `getitem` for one of several results)."""
    results = [collective] + [u for u in collective.users if u.target is operator.getitem]
    return [u for r in results for u in r.users if u.target is WAIT]


def _held_to_wait(nodes: list[list[fx.Node]], piece_of: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Inputs of a collective waited for in a later piece than it is issued in, with the last such
    piece. The collective reads them while it runs; inside one graph Inductor keeps them alive up to
    the wait (its volatile reads), but a piece that issues it without the wait would free or reuse
    their memory at once, and the collective would send whatever comes to be written there."""
    held: dict[fx.Node, int] = {}
    for k, piece in enumerate(nodes):
        for node in piece:
            if is_collective(node) and node.target is not WAIT:
                last = max((piece_of[w] for w in _waits(node)), default=k)
                for a in node.all_input_nodes if last > k else ():
                    held[a] = max(held.get(a, k), last)
    return held


def _activation_collectives(gm: fx.GraphModule) -> set[fx.Node]:
    """Collectives of activations and their waits: tensor parallelism's gathers and reduce-scatters around
    its matmuls, expert parallelism's all-to-alls; neither a parameter's gather (read from the graph's
    inputs alone) nor a gradient's reduction (returned, or read by the traced update). They are the same
    in every block, so they stay with the compute around them, as in the whole-graph compile (cut out,
    llama3 8B at dp_shard 2 x tp 2 ran 1,008 pieces a step, 40 of them distinct, on 4 H200s)."""
    from_inputs = computed_from_inputs(gm)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is WAIT or not is_collective(node):
            continue
        if all(a in from_inputs for a in node.all_input_nodes) or is_gradient_reduction(node):
            continue
        waits = _waits(node)
        if any(read_by_update(w, pos) is not None for w in waits):
            continue
        found.add(node)
        found.update(waits)
    return found


def _communication_runs(gm: fx.GraphModule) -> set[fx.Node]:
    """The ops of the graph's communication runs: collectives, their waits and the ops that only feed
    them from the graph's inputs (`blocks.communication_nodes`: a bucket's concatenation of parameter
    shards), and after each of these the contiguous ops computed from the run alone (a gathered
    bucket's split into parameters); not the collectives of activations (`_activation_collectives`). A
    gradient's concatenation into a reduce-scatter bucket is computed from activations and stays with
    the compute before it, so Inductor still writes the matmuls' outputs into the bucket."""
    comm = communication_nodes(gm) - _activation_collectives(gm)
    runs: set[fx.Node] = set()
    run: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node in comm or run and all(a in run for a in node.all_input_nodes):
            run.add(node)
            runs.add(node)
        else:
            run = set()
    return runs


def cut(gm: fx.GraphModule, starts: list[BlockStart]) -> tuple[list[list[fx.Node]], set[fx.Node], set[fx.Node]]:
    """The graph's ops in pieces, cut before each block phase's first op, before each parameter's update
    traced in (`blocks.UPDATE_KEY`), around each communication run (`_communication_runs`) and around the
    ops that build FlexAttention's masks (`flex_attention_masks`); ops nothing reads are left out
    (`unread_ops`). Which
    collectives a block issues and waits for differs at the ends of each phase (no block left to
    prefetch, the first block's gather issued by the prologue, the loss's parameters): in pieces of
    their own, they leave the blocks' compute the same from the first block to the last, and the
    pieces that hold only communication are cheap to compile. A `getitem` stays with the op whose
    multiple outputs it takes (a piece's outputs are tensors); attributes are in no piece (a constant
    is an input of each piece that reads it, a subgraph is copied into it). Returns the pieces, the
    communication runs' ops and the masks' ops."""
    boundaries = {s.node for s in starts} | set(update_starts(gm))
    runs = _communication_runs(gm)
    masks = flex_attention_masks(gm)
    unread = unread_ops(gm)
    pieces: list[list[fx.Node]] = [[]]
    home: dict[fx.Node, list[fx.Node]] = {}
    previous: fx.Node | None = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or node in unread:
            continue
        if node.target is operator.getitem and node.args[0] in home:
            home[node] = home[node.args[0]]
            home[node].append(node)
            continue
        # a block's first op made from its gathered parameters alone stays with the run that unpacks them
        within_run = previous in runs and node in runs
        turns = previous is not None and ((node in runs) != (previous in runs) or (node in masks) != (previous in masks))
        if (node in boundaries and not within_run or turns) and pieces[-1]:
            pieces.append([])
        pieces[-1].append(node)
        home[node] = pieces[-1]
        previous = node
    return pieces, runs, masks


def split(gm: fx.GraphModule, starts: list[BlockStart]) -> tuple[list[Piece], list[Any], Any, int] | None:
    """The pieces with their slots, the constants (tensors the graph reads as attributes, passed as
    inputs after the graph's own), the output structure (slots in place of nodes) and the slot count.
    None when a value that is not a tensor, or has no traced value, would cross pieces."""
    nodes, runs, masks = cut(gm, starts)
    slot: dict[fx.Node, int] = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    constants = [n for n in gm.graph.nodes if _is_constant(gm, n)]
    for n in constants:
        slot[n] = len(slot)
    piece_of = {n: k for k, piece in enumerate(nodes) for n in piece}
    output = gm.graph.output_node()
    last_read: dict[fx.Node, int] = {}
    for k, piece in enumerate(nodes):
        for n in piece:
            for a in n.all_input_nodes:
                last_read[a] = k
    for a in output.all_input_nodes:
        last_read[a] = len(nodes)
    held = _held_to_wait(nodes, piece_of)
    needed_later = {n for n, k in (*last_read.items(), *held.items()) if n in piece_of and k > piece_of[n]}
    # an input read only by the output (aot's forward graph hands the backward the device mesh of a DTensor
    # parameter, an opaque object on torch 2.13) reaches no piece, and need not be a tensor
    read_by_pieces = {a for piece in nodes for n in piece for a in n.all_input_nodes}
    read_across = needed_later | {n for n in read_by_pieces if n.op == "placeholder" or _is_constant(gm, n)}
    if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in read_across):
        return None
    pieces = []
    for k, piece in enumerate(nodes):
        inside = set(piece)
        reads = list(dict.fromkeys(a for n in piece for a in n.all_input_nodes if a not in inside))
        inputs = [a for a in reads if not is_subgraph(gm, a)]
        outputs = [n for n in piece if n in needed_later]
        for n in outputs:
            slot[n] = len(slot)
        frees = [slot[a] for a in inputs if last_read[a] == k and held.get(a, -1) < k]
        releases = [slot[a] for a, until in held.items() if until == k and until >= last_read[a]]
        communication = all(n in runs or n.target is operator.getitem for n in piece)
        builds_masks = all(n in masks or n.target is operator.getitem for n in piece)
        source = PieceSource(gm, [a for a in reads if is_subgraph(gm, a)], inputs, piece, outputs)
        pieces.append(Piece(source, [slot[a] for a in inputs], [slot[n] for n in outputs], frees, releases, communication,
                            builds_masks))
    result = fx.node.map_arg(output.args[0], lambda n: _Slot(slot[n]))
    return pieces, [getattr(gm, n.target) for n in constants], result, len(slot)


class _Slot:
    def __init__(self, index: int):
        self.index = index


def boxed(compiled: Compiled) -> Callable[[list[Any]], Any]:
    """Call `compiled` with a list it takes over, so that the inputs it reads last are freed inside it.

    standalone_compile's artifact takes positional arguments, which the frames of its wrappers keep
    alive to the end of the call. Under them, AOTAutograd's `forward` passes its module's parameters
    and buffers (a piece has none: its constants are inputs) and the arguments in a new list to
    `compiled_fn`, which clears it, as the Inductor code under it clears its own: that function is
    called here. Where the wrappers are not the ones of torch 2.11-2.13, the positional call.
    """
    forward = getattr(getattr(compiled.fn, "_compiled_fn", None), "__wrapped__", None)
    code = getattr(forward, "__code__", None)
    if code is not None and code.co_name == "forward" and not compiled.boxed:
        cells = {name: cell.cell_contents for name, cell in zip(code.co_freevars, forward.__closure__ or ())}
        if "compiled_fn" in cells and cells.get("params_buffers_flat") == []:
            return cells["compiled_fn"]

    def positional(args: list[Any]) -> Any:
        values = list(args)
        args.clear()
        return compiled.fn(values) if compiled.boxed else compiled.fn(*values)

    return positional


def views_only(module: fx.GraphModule) -> bool:
    """Every op of `module` is a view of its input (the alias the step returns its loss through, cut off
    by the wait before it): no kernel to compile, and Inductor's artifact of such a graph is empty, so
    the compile cache could never store it and every start would count a miss."""
    return all(n.op != "call_function" or n.target is operator.getitem or getattr(n.target, "is_view", False)
               for n in module.graph.nodes)


FX_RUNS = 2
"""A group of communication pieces that a step runs at most this often runs as FX, not compiled: the ends
of each phase's prefetch window (the prologue that gathers the first blocks, the last blocks that
prefetch nothing, the loss's parameters) each make a group of their own. Each such compile is one of
Inductor's fixed costs per graph (llama3 8B at dp_shard 4: 9 of the step's 21 compiles); as
FX the group's casts and copies run as separate kernels, once or twice a step."""


MULTI_TENSOR_REDUCTIONS = {torch.ops.aten._foreach_norm.Scalar}
"""Ops whose ATen kernel reduces every tensor of a list in one multi-tensor launch, where Inductor writes a reduction
per tensor: a piece holding one runs as FX. The in-graph optimizer's gradient norm is such a piece (the norms of the
291 gradients of llama3 8B, their stack and power): compiled, it took 4.7-6.4 s in a compile worker, the longest of
the step's pieces, which the first step then waited on (one H200: bench/results/2026-11-29-session19)."""


def runs_as_fx(members: list[Piece]) -> bool:
    """Whether a group of pieces runs as FX: it only takes views (`views_only`), it is communication the
    step runs at most `FX_RUNS` times, it builds FlexAttention's masks, or it holds a multi-tensor reduction
    (`MULTI_TENSOR_REDUCTIONS`). Those masks ran as FX before the step was compiled by pieces
    (`inductor.split_mask_prologue`); compiled, DeepSeek V3 16B's (document masks, 4 x 4096 tokens a rank)
    took 71.1 s in a compile worker, when no other piece took more than 20.4 s (one H200, torch 2.11:
    bench/results/2026-11-29-session18)."""
    first = members[0]
    return (views_only(first.module) or first.builds_masks or first.communication and len(members) <= FX_RUNS
            or any(node.target in MULTI_TENSOR_REDUCTIONS for node in first.module.graph.nodes))


@dataclass(frozen=True)
class Slots:
    """Where one piece's values live while the step runs (`Piece`'s fields of the same names)."""

    inputs: list[int]
    outputs: list[int]
    frees: list[int]
    releases: list[int]


@dataclass
class GroupCall:
    """How a group's pieces run: `call` (boxed), made from the compile-cache entry `key` (a compiled group whose
    compile the job's cache holds) or from `module` (a group run as FX); neither where the compile was not stored.
    capture/step_cache.py stores a runner by these and makes it again from them."""

    call: Callable[[list[Any]], Any]
    key: str | None = None
    module: fx.GraphModule | None = None


class PieceRunner:
    """Runs the pieces in graph order, each piece (`Slots`) with its group's call (`order`: the group of each)."""

    def __init__(self, slots_of: list[Slots], order: list[int], groups: list[GroupCall], constants: list[Any], result: Any,
                 slots: int):
        self.slots_of = slots_of
        self.order = order
        self.groups = groups
        self.constants = constants
        self.result = result
        self.slots = slots
        self._steps = [(piece, groups[group].call) for piece, group in zip(slots_of, order)]

    def __call__(self, *args: Any) -> Any:
        env: list[Any] = [*args, *self.constants]
        env += [None] * (self.slots - len(env))
        for piece, call in self._steps:
            ins = [env[i] for i in piece.inputs]
            for i in piece.frees:
                env[i] = None
            for i, value in zip(piece.outputs, call(ins)):
                env[i] = value
            for i in piece.releases:
                env[i] = None
        return fx.node.map_aggregate(self.result, lambda s: env[s.index] if isinstance(s, _Slot) else s)


@dataclass
class PiecePlan:
    pieces: list[Piece]
    groups: list[list[Piece]]
    """Pieces by structure, in the order of their first piece."""
    constants: list[Any]
    result: Any
    slots: int

    @property
    def compiled_groups(self) -> list[list[Piece]]:
        """The groups that are compiled (the others run as FX: `runs_as_fx`)."""
        return [members for members in self.groups if not runs_as_fx(members)]

    def compile(self, ctx: PassContext, compile_fn: Callable[[fx.GraphModule, PassContext], Compiled]) -> PieceRunner:
        """Compile each group's first piece with `compile_fn`, or run it as FX (`runs_as_fx`); the runner
        calls it for every member."""
        groups: list[GroupCall] = []
        group_of: dict[int, int] = {}
        for index, members in enumerate(self.groups):
            module = members[0].module
            if runs_as_fx(members):
                groups.append(GroupCall(boxed(Compiled(module, module)), module=module))
            else:
                compiled = compile_fn(module, ctx)
                groups.append(GroupCall(boxed(compiled), key=compiled.cache_key))
            for piece in members:
                group_of[id(piece)] = index
        return PieceRunner([Slots(p.inputs, p.outputs, p.frees, p.releases) for p in self.pieces],
                           [group_of[id(p)] for p in self.pieces], groups, self.constants, self.result, self.slots)


def plan_pieces(gm: fx.GraphModule, phase: Phase | None = None) -> PiecePlan | None:
    """The pieces of `gm` (of one `phase` only: aot's forward or backward graph, see `blocks.block_starts`)
    grouped by structure; None when it has no marked blocks or cannot be cut."""
    starts = block_starts(gm, phase)
    found = split(gm, starts) if starts else None
    if found is None:
        return None
    pieces, constants, result, slots = found
    groups: dict[str, list[Piece]] = {}
    for piece in pieces:
        groups.setdefault(piece.source.structure(), []).append(piece)
    return PiecePlan(pieces, list(groups.values()), constants, result, slots)


_SOURCE = "piece_source"
"""A piece op's position in its piece, marked while the piece is decomposed: fx copies an op's `custom`
metadata to the ops it decomposes into, so each copy of the decomposition can take the metadata of its
own piece's op."""

_OWN_META = ("custom", "nn_module_stack", "stack_trace", "seq_nr", "source_fn_stack", "from_node")
"""Metadata that differs between the pieces of one group (the block mark, the module path, the source)."""


def _own_meta(node: fx.Node, sources: list[fx.Node]) -> None:
    position = (node.meta.get("custom") or {}).get(_SOURCE)
    if position is None:
        return
    source = sources[position].meta
    for key in _OWN_META:
        if key in source:
            node.meta[key] = source[key]
        else:
            node.meta.pop(key, None)
    custom = {k: v for k, v in (node.meta.get("custom") or {}).items() if k != _SOURCE}
    if custom:
        node.meta["custom"] = custom
    else:
        node.meta.pop("custom", None)


PIECES = "piece_plan"
"""`GraphModule.meta` key of a train step decomposed by pieces: the `PiecePlan` whose pieces run the
decompositions, so that the full compile, the next pass, compiles them without cutting the graph again."""


def decompose_pieces(plan: PiecePlan, decompose: Callable[[fx.GraphModule], fx.GraphModule | None]) -> PiecePlan:
    """The plan with every piece replaced by its group's decomposition: each group's first piece goes
    through `decompose` once (llama3 70B's 80 blocks took 32 s to decompose whole on the GPU machine;
    its 18 distinct pieces take 6.1 s, one H200). A group that runs as FX (`runs_as_fx`) stays as it is, as
    does one for which `decompose` returns None (its compile is cached)."""
    groups: list[list[Piece]] = []
    for members in plan.groups:
        first = members[0].module
        for position, node in enumerate(first.graph.nodes):
            node.meta["custom"] = {**(node.meta.get("custom") or {}), _SOURCE: position}
        result = None if runs_as_fx(members) else decompose(first)
        groups.append([replace(piece, built=result if result is not None else first) for piece in members])
    new = {id(old): piece for old_members, members in zip(plan.groups, groups) for old, piece in zip(old_members, members)}
    return PiecePlan([new[id(piece)] for piece in plan.pieces], groups, plan.constants, plan.result, plan.slots)


def stitch(gm: fx.GraphModule, plan: PiecePlan, decomposed: PiecePlan) -> fx.GraphModule:
    """`gm` (cut as `plan`) with each piece's ops replaced by those of its `decomposed` module, reading
    its own inputs. Decomposition works op by op, so where every piece was decomposed this is the graph
    that decomposing `gm` whole gives, less the ops nothing reads (`unread_ops`), ops in the same order,
    each copy carrying its own piece's metadata."""
    group_of = {id(piece): index for index, members in enumerate(decomposed.groups) for piece in members}
    graph = fx.Graph()
    env: list[fx.Node | None] = [graph.node_copy(n) for n in gm.graph.find_nodes(op="placeholder")]
    env += [graph.node_copy(n) for n in gm.graph.nodes if _is_constant(gm, n)]
    env += [None] * (plan.slots - len(env))
    attributes: dict[tuple[int, str], str] = {}
    for k, (original, piece) in enumerate(zip(plan.pieces, decomposed.pieces)):
        index, result = group_of[id(piece)], piece.module
        # the step's own nodes: copying each piece's module only to read its ops' metadata would undo the lazy copies
        sources = original.source.nodes()
        values = dict(zip(result.graph.find_nodes(op="placeholder"), (env[i] for i in piece.inputs)))
        for node in result.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                for i, out in zip(piece.outputs, node.args[0]):
                    env[i] = values[out]
                continue
            if node.op == "get_attr":
                # the decomposition's own attributes (subgraphs, lifted constants), one copy per group
                if (index, node.target) not in attributes:
                    attributes[index, node.target] = f"_piece{index}_{node.target}"
                    setattr(gm, attributes[index, node.target], getattr(result, node.target))
                values[node] = graph.get_attr(attributes[index, node.target])
                values[node].meta = dict(node.meta)
                _own_meta(values[node], sources)
                continue
            values[node] = copy_node_as(graph, node, values.__getitem__, f"{node.name}_{k}")
            _own_meta(values[node], sources)
    graph.output(fx.node.map_aggregate(plan.result, lambda s: env[s.index] if isinstance(s, _Slot) else s))
    return fx.GraphModule(gm, graph)
