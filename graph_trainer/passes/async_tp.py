"""async_tp: the tensor-parallel all-gather that feeds column-parallel matmuls, and the reduce-scatter
that follows a row-parallel matmul, micro-pipelined so that communication overlaps the matmul.

Sites, as DTensor's sequence-parallel plans trace them (llama3, Qwen3, DeepSeek V3's attention and
dense MLPs):
- gather: `all_gather(x) -> wait [-> split(dim 0) -> cat(dim d)] -> view(rows, k) -> mm(., B_i)` for
  one or more B_i (wq, wk, wv share one gathered input; w1 and w3 another); with a batch of one,
  `all_gather(x) -> wait -> view(1, ranks * s, k)` in place of the split and cat. The gathered
  activation also stays an output: backward's weight gradients read it.
- scatter: `mm(A, B) -> view [-> split(dim d) -> cat(dim 0)] -> reduce_scatter(sum)`.
Only gathers and scatters along a dimension other than the last (the rows of the matmul) qualify; a
gather of the contraction or vocabulary dimension (the output projection's logits) is left alone, as
are backward's input gradients, which sum several matmuls before their reduce-scatter.

Lowerings (`--compile.async_tp_lowering`; auto: symm_mem where it can run):
- `symm_mem` (CUDA, real process group): torch's `symm_mem.fused_all_gather_matmul` and
  `fused_matmul_reduce_scatter`, which pipeline the matmul over per-peer P2P copies into symmetric
  memory; the TP group is registered for symmetric memory when the pass runs. They need CUDA peer
  access between the TP ranks (NVLink or PCIe P2P), not NVLink multicast, which stays off.
- `chunked` (any device and process group, gloo included): the local shard is cut into
  `--compile.async_tp_chunks` slices along the gathered (scattered) dimension, and each slice travels
  by its own functional collective, issued before the previous slice's matmul runs: slice c's matmul
  overlaps slice c+1's all-gather, slice c's reduce-scatter overlaps slice c+1's matmul. Rows are then
  put back in the unsplit order (a copy of the matmul output and of the gathered activation). On 2
  H200s it left most of its collectives exposed: 0.92x the symm_mem lowering at llama3 8B-16L tp 2.
Each output row is the same dot product as without the pass and each reduced element sums the same
rank values, so only a matmul kernel that rounds differently for fewer rows can change results.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from ..parallel.compat import is_fake_process_group
from .bucket_merge import emit
from .bucketing_compat import ALL_GATHER, REDUCE_SCATTER, WAIT, ancestors
from .compat import enable_symmetric_memory, symm_mem_ops
from .gather_group import gathers_parameters
from .registry import PassContext, PassSpec, register_pass

aten = torch.ops.aten
PIPELINED = "async_tp_chunk"
"""`node.meta` key of the collectives the chunked lowering emits (their chunk): not sites again."""
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


@dataclass
class GatherSite:
    start: fx.Node
    gathered: fx.Node
    """The gathered activation in its unsplit layout (the wait, or the cat that reorders it)."""
    dim: int
    matmuls: list[fx.Node]
    chain: list[fx.Node]
    """From `gathered` back to the all-gather: what the lowering replaces."""


@dataclass
class ScatterSite:
    matmul: fx.Node
    start: fx.Node
    wait: fx.Node
    dim: int
    shape: list[int]
    """The matmul output's shape before it is split for the ranks (its rows unflattened)."""
    chain: list[fx.Node]
    """From the wait back to the matmul: what the lowering replaces."""


def _single_wait(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].target is WAIT else None


def _split_cat(source: fx.Node, split_dim: int | None, cat_dim: int | None) -> fx.Node | None:
    """The cat of every piece of `source`'s one split, in order, when that is all they feed."""
    users = list(source.users)
    if len(users) != 1 or users[0].target is not aten.split.Tensor:
        return None
    split = users[0]
    if (split.args[2] if len(split.args) > 2 else 0) != split_dim and split_dim is not None:
        return None
    pieces = sorted(split.users, key=lambda g: g.args[1])
    cats = {u for g in pieces for u in g.users}
    if len(cats) != 1 or any(g.target is not operator.getitem or len(g.users) != 1 for g in pieces):
        return None
    cat = cats.pop()
    if cat.target is not aten.cat.default or list(cat.args[0]) != pieces:
        return None
    if cat_dim is not None and (cat.args[1] if len(cat.args) > 1 else 0) != cat_dim:
        return None
    return cat


def _rows_dim(dim: int, ndim: int) -> int | None:
    dim = dim % ndim
    return dim if ndim >= 2 and dim < ndim - 1 else None


def _batch_of_one(start: fx.Node, wait: fx.Node) -> fx.Node | None:
    """The view that makes a gather along the sequence of a batch of one out of the gather along dim 0:
    [1, s, ...] gathered to [ranks, s, ...] and viewed as [1, ranks * s, ...], the same memory (DTensor
    leaves out the split and cat where the batch is 1)."""
    local, whole = start.args[0].meta["val"].shape, wait.meta["val"].shape
    users = list(wait.users)
    if len(local) < 3 or local[0] != 1 or len(users) != 1 or users[0].target not in _VIEWS:
        return None
    view = users[0]
    return view if list(view.meta["val"].shape) == [1, whole[0] * whole[1], *whole[2:]] else None


def find_gather_sites(gm: fx.GraphModule) -> list[GatherSite]:
    sites = []
    for start in gm.graph.find_nodes(op="call_function", target=ALL_GATHER):
        wait = _single_wait(start)
        if wait is None:
            continue
        cat = _split_cat(wait, 0, None)
        if cat is not None and len(cat.args[0]) != start.args[1]:
            continue
        merged = _batch_of_one(start, wait) if cat is None else None
        gathered = cat or merged or wait
        between = [*cat.args[0], cat.args[0][0].args[0]] if cat is not None else []
        ndim = gathered.meta["val"].dim()
        dim = 1 if merged is not None else _rows_dim(cat.args[1] if cat is not None and len(cat.args) > 1 else 0, ndim)
        if dim is None:
            continue
        width = gathered.meta["val"].shape[-1]
        matmuls = [mm for view in gathered.users if view.target in _VIEWS
                   and list(view.meta["val"].shape) == [gathered.meta["val"].numel() // width, width]
                   for mm in view.users if mm.target is aten.mm.default and mm.args[0] is view]
        if matmuls:
            chain = [*([gathered] if gathered is not wait else []), *between, wait, start]
            sites.append(GatherSite(start, gathered, dim, matmuls, chain))
    return sites


def find_scatter_sites(gm: fx.GraphModule) -> list[ScatterSite]:
    sites = []
    for start in gm.graph.find_nodes(op="call_function", target=REDUCE_SCATTER):
        wait = _single_wait(start)
        source = start.args[0]
        if wait is None or start.args[1] != "sum":
            continue
        split = source.args[0][0].args[0] if source.target is aten.cat.default and source.args[0] else None
        view = split.args[0] if split is not None and split.target is aten.split.Tensor else source
        if view.target not in _VIEWS or len(view.users) != 1:
            continue
        if view is not source and (_split_cat(view, None, 0) is not source or len(source.args[0]) != start.args[2]):
            continue
        matmul = view.args[0]
        if matmul.target is not aten.mm.default or len(matmul.users) != 1:
            continue
        shape = list(view.meta["val"].shape)
        dim = _rows_dim(split.args[2] if view is not source and len(split.args) > 2 else 0, len(shape))
        if dim is None:
            continue
        between = [source, *source.args[0], split] if view is not source else []
        sites.append(ScatterSite(matmul, start, wait, dim, shape, [wait, start, *between, view, matmul]))
    return sites


def _hoist_after(nodes: list[fx.Node], anchor: fx.Node, forbidden: set[fx.Node]) -> fx.Node | None:
    """Move `nodes` and their ancestors that come after `anchor` to just after it, in order; returns
    the last node before the insertion point, or None (nothing moved) where one of them derives from a
    node in `forbidden`."""
    pos = {n: i for i, n in enumerate(anchor.graph.nodes)}
    late = {a for n in nodes for a in (n, *ancestors(n)) if pos[a] > pos[anchor]}
    if late & forbidden:
        return None
    for n in sorted(late, key=pos.__getitem__):
        anchor.append(n)
        anchor = n
    return anchor


def _descendants(node: fx.Node) -> set[fx.Node]:
    found, todo = set(), [node]
    while todo:
        for user in todo.pop().users:
            if user not in found:
                found.add(user)
                todo.append(user)
    return found


def _unsplit(graph: fx.Graph, parts: list[fx.Node], dim: int, shape: list[int], ranks: int) -> fx.Node:
    """Parts whose `dim` holds, rank by rank, one slice of each rank's rows: back to `shape`, where
    each rank's rows are contiguous along `dim` (part c holds slice c of every rank's block)."""
    split_shape = [*shape[:dim], ranks, shape[dim] // ranks // len(parts), *shape[dim + 1 :]]
    views = [emit(graph, aten.view.default, p, split_shape) for p in parts]
    return emit(graph, aten.view.default, emit(graph, aten.stack.default, views, dim + 1), shape)


def _chunked_gather(graph: fx.Graph, site: GatherSite, chunks: int) -> tuple[fx.Node, list[fx.Node]]:
    x, ranks, group = site.start.args
    dim, full = site.dim, list(site.gathered.meta["val"].shape)
    local = x.meta["val"].shape[dim]
    starts = []
    for c in range(chunks):
        piece = emit(graph, aten.slice.Tensor, x, dim, c * local // chunks, (c + 1) * local // chunks)
        starts.append(emit(graph, ALL_GATHER, emit(graph, aten.clone.default, piece, memory_format=torch.contiguous_format),
                           ranks, group))
        starts[-1].meta[PIPELINED] = c
    gathered, outs = [], [[] for _ in site.matmuls]
    for start in starts:
        part = emit(graph, WAIT, start)
        if dim != 0:
            rows = part.meta["val"].shape[0] // ranks
            pieces = emit(graph, aten.split.Tensor, part, rows)
            part = emit(graph, aten.cat.default, [emit(graph, operator.getitem, pieces, r) for r in range(ranks)], dim)
        gathered.append(part)
        flat = emit(graph, aten.view.default, part, [-1, full[-1]])
        for i, mm in enumerate(site.matmuls):
            outs[i].append(emit(graph, aten.mm.default, flat, mm.args[1]))
    whole = _unsplit(graph, gathered, dim, full, ranks)
    results = []
    for mm, parts in zip(site.matmuls, outs):
        out_shape = [*full[:-1], mm.meta["val"].shape[-1]]
        results.append(emit(graph, aten.view.default, _unsplit(graph, parts, dim, out_shape, ranks), list(mm.meta["val"].shape)))
    return whole, results


def _symm_mem_gather(graph: fx.Graph, site: GatherSite) -> tuple[fx.Node, list[fx.Node]]:
    x, _, group = site.start.args
    fused = emit(graph, symm_mem_ops().fused_all_gather_matmul.default, x, [mm.args[1] for mm in site.matmuls],
                 site.dim, group)
    outs = emit(graph, operator.getitem, fused, 1)
    # its outputs keep the gathered rows in the order they arrive (gather dim first): the graph's views of
    # the gathered activation need it contiguous, and a reshape of the outputs copies
    gathered = emit(graph, operator.getitem, fused, 0)
    if not gathered.meta["val"].is_contiguous():
        gathered = emit(graph, aten.clone.default, gathered, memory_format=torch.contiguous_format)
    return gathered, [
        emit(graph, aten.reshape.default, emit(graph, operator.getitem, outs, i), list(mm.meta["val"].shape))
        for i, mm in enumerate(site.matmuls)]


def _chunked_scatter(graph: fx.Graph, site: ScatterSite, chunks: int) -> fx.Node:
    a, b = site.matmul.args
    _, _, ranks, group = site.start.args
    dim, shape = site.dim, site.shape
    piece = shape[dim] // ranks // chunks
    part_shape = [*shape[:dim], piece, *shape[dim + 1 :]]
    rows = emit(graph, aten.view.default, a, [*shape[:dim], ranks, chunks, piece, *shape[dim + 1 : -1], -1])
    starts = []
    for c in range(chunks):
        chunk = emit(graph, aten.clone.default, emit(graph, aten.select.int, rows, dim + 1, c),
                     memory_format=torch.contiguous_format)
        out = emit(graph, aten.mm.default, emit(graph, aten.view.default, chunk, [-1, a.meta["val"].shape[-1]]), b)
        out = emit(graph, aten.view.default, out, [*shape[:dim], ranks, piece, *shape[dim + 1 :]])
        # each rank's rows together, ranks in order: the layout of the unsplit graph's cat of rank blocks
        ranked = emit(graph, aten.clone.default, emit(graph, aten.movedim.int, out, dim, 0),
                      memory_format=torch.contiguous_format)
        send = emit(graph, aten.view.default, ranked, [ranks * part_shape[0], *part_shape[1:]])
        starts.append(emit(graph, REDUCE_SCATTER, send, "sum", ranks, group))
        starts[-1].meta[PIPELINED] = c
    return emit(graph, aten.cat.default, [emit(graph, WAIT, start) for start in starts], dim)


def _symm_mem_scatter(graph: fx.Graph, site: ScatterSite) -> fx.Node:
    a, b = site.matmul.args
    _, _, _, group = site.start.args
    unflat = emit(graph, aten.view.default, a, [*site.shape[:-1], a.meta["val"].shape[-1]])
    return emit(graph, symm_mem_ops().fused_matmul_reduce_scatter.default, unflat, b, "sum", site.dim, group)


def _erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    for node in nodes:
        if not node.users:
            graph.erase_node(node)


def _lower_gather(graph: fx.Graph, site: GatherSite, chunks: int | None) -> bool:
    """`chunks`: the chunked lowering's slices; None: symmetric memory."""
    anchor = _hoist_after([mm.args[1] for mm in site.matmuls], site.gathered, _descendants(site.start))
    if anchor is None:
        return False
    with graph.inserting_before(anchor.next):
        whole, results = _symm_mem_gather(graph, site) if chunks is None else _chunked_gather(graph, site, chunks)
    views = [mm.args[0] for mm in site.matmuls]
    for mm, result in zip(site.matmuls, results):
        mm.replace_all_uses_with(result)
        graph.erase_node(mm)
    site.gathered.replace_all_uses_with(whole)
    _erase_unused(graph, [*dict.fromkeys(views), *site.chain])
    return True


def _lower_scatter(graph: fx.Graph, site: ScatterSite, chunks: int | None) -> None:
    with graph.inserting_before(site.matmul):
        result = _symm_mem_scatter(graph, site) if chunks is None else _chunked_scatter(graph, site, chunks)
    site.wait.replace_all_uses_with(result)
    _erase_unused(graph, site.chain)


def tp_group(ctx: PassContext) -> str | None:
    if ctx.meshes is None or ctx.meshes.degrees.tp == 1:
        return None
    return ctx.meshes.tp.get_group().group_name


def tp_sites(gm: fx.GraphModule, group: str | None, num_params: int) -> tuple[list[GatherSite], list[ScatterSite]]:
    """The sites whose collective runs over the TP group (never a parameter's all-gather: where the TP
    group is also an FSDP one, a gathered weight is no activation); none without a TP group."""
    if group is None:
        return [], []
    params = set(gm.graph.find_nodes(op="placeholder")[:num_params])
    gathers = [s for s in find_gather_sites(gm) if s.start.args[2] == group and PIPELINED not in s.start.meta
               and not gathers_parameters(s.start, params)]
    scatters = [s for s in find_scatter_sites(gm) if s.start.args[3] == group and PIPELINED not in s.start.meta]
    return gathers, scatters


def _divides(site: GatherSite | ScatterSite, chunks: int | None) -> bool:
    """Whether the lowering takes the site: symmetric memory any, the chunked one where its slices are whole rows
    of each rank's share."""
    if chunks is None:
        return True
    if isinstance(site, GatherSite):
        return site.start.args[0].meta["val"].shape[site.dim] % chunks == 0
    return site.shape[site.dim] // site.start.args[2] % chunks == 0


def uses_symm_mem(cfg, device: torch.device) -> bool:
    """Whether `--compile.async_tp_lowering` (auto: where it can run) picks symmetric memory."""
    lowering = cfg.compile.async_tp_lowering
    return lowering == "symm_mem" or (lowering == "auto" and device.type == "cuda" and not is_fake_process_group())


def async_tp(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    group = tp_group(ctx)
    symm_mem = uses_symm_mem(ctx.cfg, ctx.device)
    chunks = None if symm_mem else ctx.cfg.compile.async_tp_chunks
    gathers, scatters = tp_sites(gm, group, ctx.num_params)
    lowered_gathers = sum(_lower_gather(gm.graph, s, chunks) for s in gathers if _divides(s, chunks))
    lowered_scatters = 0
    for site in scatters:
        if _divides(site, chunks):
            _lower_scatter(gm.graph, site, chunks)
            lowered_scatters += 1
    if symm_mem and (lowered_gathers or lowered_scatters):
        enable_symmetric_memory(group)
    gm.graph.lint()
    gm.recompile()
    ctx.report.setdefault("async_tp", {}).update(
        async_tp_lowering="symm_mem" if symm_mem else "chunked",
        async_tp_gathers=lowered_gathers, async_tp_gather_matmuls=sum(len(s.matmuls) for s in gathers),
        async_tp_scatters=lowered_scatters, async_tp_sites_found=len(gathers) + len(scatters))
    return gm


register_pass(PassSpec(
    name="async_tp",
    description="TP all-gather -> column-parallel matmuls and row-parallel matmul -> reduce-scatter, micro-pipelined",
    stages=("train_step",),
    modes=("aot_fx_trace",),
    fn=async_tp,
    needs_degrees=("tp",),
))
