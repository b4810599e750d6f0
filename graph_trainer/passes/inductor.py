"""Inductor passes: decompose a graph into Inductor's op set, compile all of it, or compile only the
regions the model marked (graph_trainer/regions.py).

The graphs these passes get hold fake tensors in `node.meta["val"]` (make_fx and AOTAutograd put them
there); compiling from those needs no real memory and matches the traced shapes exactly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from .. import compile_cache
from ..config import cache_folder
from ..graph_dump import is_collective
from ..blocks import block_count
from ..regions import REGION_KEY
from . import compile_workers
from .block_compile import PIECES, PiecePlan, decompose_pieces, flex_attention_masks, plan_pieces, stitch
from .compat import (
    FakeTensorMode,
    TracingContext,
    detect_fake_mode,
    regional_inductor,
    select_decomp_table,
    standalone_compile,
    tracing,
)
from .registry import GRAPH_MODES, Compiled, PassContext, PassSpec, register_pass

logger = logging.getLogger("graph_trainer")


def fake_inputs(gm: fx.GraphModule, ctx: PassContext) -> list[Any]:
    """The graph's inputs as fake tensors that do not require grad: the placeholders' traced values,
    or fakes of the context's example inputs where a placeholder has none."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if all(v is not None for v in vals):
        return [v.detach() if isinstance(v, torch.Tensor) else v for v in vals]
    mode = detect_fake_mode(ctx.example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    return [mode.from_tensor(x.detach()) if isinstance(x, torch.Tensor) else x for x in ctx.example_inputs]


def inductor_decomposition(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Retrace the graph through Inductor's decomposition table, keeping each node's metadata (region
    marks, seq_nr, stack traces) on the ops it decomposes into; a train step whose blocks the full
    compile reuses is decomposed one distinct piece at a time (block_compile.decompose_pieces), and a
    piece whose compile the job's cache holds is not decomposed at all (`PieceEntry`). The rank's compile
    workers (compile_workers.py), where it has them, first compile the pieces the cache lacks into it, so
    that none is left to decompose or compile here."""
    plan = _reusable_plan(gm, ctx)
    workers = compile_workers.take()
    try:
        if plan is None:
            return decompose(gm, fake_inputs(gm, ctx))
        cache = _cache(ctx)
        report = ctx.report.setdefault("inductor_decomposition", {})
        before = report.setdefault("decomposed_pieces", 0)
        entries = _entries(plan, ctx, cache)
        firsts = {id(members[0].module): members[0].module for members in plan.compiled_groups}
        missing = [(firsts[i], entry) for i, entry in entries.items() if not cache.path(entry.key).exists()]
        if workers is None and len(missing) > 1:
            workers = compile_workers.launch(ctx.cfg, ctx.device)
        if workers is not None and missing:
            _compile_in_workers(workers, missing, ctx, cache)
        decomposed = decompose_pieces(plan, lambda piece: _decompose_unless_cached(piece, ctx, cache, entries.get(id(piece))))
    finally:
        if workers is not None:
            compile_workers.give_back(workers)
    # where every compile was cached, the graph stays as traced: it is only dumped
    out = stitch(gm, plan, decomposed) if report["decomposed_pieces"] > before else gm
    out.meta[PIECES] = decomposed
    return out


@dataclass
class PieceEntry:
    """A piece's compile-cache key, taken before its decomposition, in `GraphModule.meta`.

    The decomposition is a function of the piece and of torch, both in the key, so the key of the
    piece as traced names its decomposed compile as well: a start that finds the entry skips the
    decomposition too (on the GPU machine, llama3 8B on 4 GPUs: 7.7 s of a warm start's 30.6 s went
    to decomposing 22 distinct pieces whose compiles it then loaded). The piece then stays as traced
    in the graph the pass returns (and in its dump); where its entry cannot be loaded after all, the
    compile decomposes it first. The pieces' calling convention is their own either way: decomposing
    keeps a graph's inputs and outputs."""

    key: str
    parts: dict
    options: dict | None = None
    """The Inductor options it is keyed and compiled with (`_options`, of the piece as traced)."""
    decomposed: bool = False
    by_worker: bool = False
    """Compiled by a compile worker of this start (a miss the worker paid, not a hit)."""
    artifact: Any = None
    """The compile a worker stored, loaded by the rank while the workers compiled other pieces (`_compile_in_workers`)."""


_ENTRY = "compile_cache_entry"


def _cache(ctx: PassContext) -> compile_cache.CompileCache | None:
    folder = cache_folder(ctx.cfg)
    return compile_cache.CompileCache(folder) if folder is not None else None


def _entries(plan: PiecePlan, ctx: PassContext, cache: compile_cache.CompileCache | None) -> dict[int, PieceEntry]:
    """The cache entry of each group's first piece that computes something, by the piece's id."""
    if cache is None:
        return {}
    entries = {}
    options = _options(ctx)
    for members in plan.compiled_groups:
        piece = members[0].module
        entries[id(piece)] = PieceEntry(*compile_cache.cache_key(piece, fake_inputs(piece, ctx), options, ctx.device, ctx.meshes),
                                        options=options)
    return entries


def _compile_in_workers(workers: compile_workers.CompileWorkers, missing: list[tuple[fx.GraphModule, PieceEntry]],
                        ctx: PassContext, cache: compile_cache.CompileCache) -> None:
    """Have the workers compile the pieces whose entries the cache lacks; report how many and how long."""
    jobs = [compile_workers.Job(entry.key, entry.parts, piece, entry.options) for piece, entry in missing]
    by_key = {entry.key: entry for _, entry in missing}
    start = time.perf_counter()
    outcomes = workers.compile(jobs, cache, on_stored=lambda key: _preload(cache, by_key[key]), meanwhile=ctx.meanwhile)
    # a piece without an outcome was never taken: every worker had died
    for _, entry in missing:
        entry.by_worker = outcomes.get(entry.key) == ""
    done = sum(entry.by_worker for _, entry in missing)
    if done < len(jobs):
        why = next((why for why in outcomes.values() if why), "no worker left")
        logger.warning(f"compile workers: {len(jobs) - done} of {len(jobs)} pieces failed, compiled here instead (first: {why})")
    report = ctx.report["inductor_decomposition"]
    report["compile_workers"] = len(workers.procs)
    report["compile_workers_started_early"] = workers.early
    # whether the workers were the wait: seconds from their start to the first piece sent, and to the last one ready
    report["compile_workers_first_piece_s"] = workers.first_job
    if workers.ready:
        report["compile_workers_ready_s"] = max(workers.ready)
    report["worker_compiled_pieces"] = report.get("worker_compiled_pieces", 0) + done
    report["compile_workers_s"] = report.get("compile_workers_s", 0.0) + time.perf_counter() - start


def _preload(cache: compile_cache.CompileCache, entry: PieceEntry) -> None:
    """Load the compile a worker just stored, while the rank waits on the others (on one H200, llama3 8B at dp_shard
    8: the full compile's 12 loads took 0.9-1.1 s after the workers' last piece, bench/results/2026-11-29-session19).
    An entry that cannot be loaded is left to the full compile, which loads it again and says why."""
    try:
        entry.artifact = cache.load(entry.key)
    except compile_cache.Refused:
        pass


def _decompose_unless_cached(piece: fx.GraphModule, ctx: PassContext, cache: compile_cache.CompileCache | None,
                             entry: PieceEntry | None) -> fx.GraphModule | None:
    """The piece decomposed (and marked with its entry), or None where its entry exists (the piece is
    marked). Counts `decomposed_pieces`."""
    if entry is not None:
        entry.decomposed = not cache.path(entry.key).exists()
        if not entry.decomposed:
            piece.meta[_ENTRY] = entry
            return None
    result = decompose(piece, fake_inputs(piece, ctx))
    if entry is not None:
        result.meta[_ENTRY] = entry
    ctx.report["inductor_decomposition"]["decomposed_pieces"] += 1
    return result


def decompose(gm: fx.GraphModule, inputs: list[Any]) -> fx.GraphModule:
    """`gm` retraced through Inductor's decomposition table on its fake `inputs` (a graph that reads none, as
    the `arange` FlexAttention's masks start from, in a fake mode of its own)."""
    mode = detect_fake_mode(inputs) or FakeTensorMode()
    with mode, fx_traceback.preserve_node_meta():
        return make_fx(fx.Interpreter(gm).run, decomposition_table=select_decomp_table(), tracing_mode="real")(*inputs)


def _drop_unused_opaque_inputs(gm: fx.GraphModule) -> list[int] | None:
    """Remove placeholders that hold neither a tensor nor a number and that nothing reads; return the
    positions of the inputs kept, or None when every input stays.

    AOTAutograd on torch 2.13 passes a DTensor parameter's device mesh as a graph input of its own;
    Inductor's compiled artifact leaves such an input out of the call while the code it generated
    still counts it, so the call fails. The graph never reads it, so it need not be an input at all.
    """
    placeholders = gm.graph.find_nodes(op="placeholder")
    kept = []
    for i, node in enumerate(placeholders):
        if node.users or isinstance(node.meta.get("val"), (torch.Tensor, torch.SymInt, int, float, bool)):
            kept.append(i)
        else:
            gm.graph.erase_node(node)
    if len(kept) == len(placeholders):
        return None
    gm.recompile()
    return kept


def split_mask_prologue(gm: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule] | None:
    """Split off the part of the graph that builds FlexAttention's masks from the token ids alone.

    Returns (prologue, main), or None when no FlexAttention op reads such a mask. The prologue takes
    the graph's inputs and returns the mask tensors; `main` takes the graph's inputs followed by
    them. Inductor (torch 2.11) cannot compile FlexAttention whose block mask and mask-function
    buffers are computed in the same graph: it indexes them before their layout is fixed ("convert
    FlexibleLayout to FixedLayout first"). Given as inputs, as `torch.compile` sees them when the
    mask is built by its own call, they compile into the fused kernels.
    """
    prologue = flex_attention_masks(gm)
    if not prologue:
        return None
    outputs = [n for n in gm.graph.nodes if n in prologue and any(u not in prologue for u in n.users)]
    placeholders = gm.graph.find_nodes(op="placeholder")

    def copy(graph: fx.Graph, nodes: list[fx.Node], env: dict[fx.Node, fx.Node]) -> None:
        for node in nodes:
            env[node] = graph.node_copy(node, lambda a: env[a])

    first, env = fx.Graph(), {}
    copy(first, placeholders + [n for n in gm.graph.nodes if n in prologue], env)
    first.output(tuple(env[n] for n in outputs))
    second, env = fx.Graph(), {}
    copy(second, placeholders, env)
    for node in outputs:
        env[node] = second.placeholder(f"{node.name}_mask")
        env[node].meta = dict(node.meta)
    copy(second, [n for n in gm.graph.nodes if n.op != "placeholder" and n not in prologue], env)
    return fx.GraphModule(gm, first), fx.GraphModule(gm, second)


def full_inductor_compilation(gm: fx.GraphModule, ctx: PassContext) -> Compiled:
    """Compile the whole graph, collectives included, with Inductor: by the pieces it was decomposed in
    (`PIECES`; FlexAttention's masks are pieces of their own, run as FX), else whole, a FlexAttention mask
    built from the token ids running before it as FX (`split_mask_prologue`)."""
    split = None if PIECES in gm.meta else split_mask_prologue(gm)
    if split is None:
        return _compile_by_pieces(gm, ctx)
    prologue, main = split
    compiled = _compile_by_pieces(main, ctx)
    return Compiled(lambda *args: compiled(*args, *prologue(*args)), main)


def _compile_by_pieces(gm: fx.GraphModule, ctx: PassContext) -> Compiled:
    """A graph with more transformer blocks than distinct pieces (passes/block_compile.py: the whole
    step, aot's forward and backward graphs, a pipeline stage's) compiles each distinct piece once,
    unless `--compile.block_reuse false`; any other graph whole. Adds to the report, over the graphs of
    a capture: `compiled_blocks` (graphs Inductor compiled), `block_pieces` (graphs a step runs) and
    `layers` (the blocks of the step or of the forward graphs)."""
    plan = gm.meta.get(PIECES) or _reusable_plan(gm, ctx)
    compiled, pieces = (1, 1) if plan is None else (len(plan.compiled_groups), len(plan.pieces))
    report = ctx.report.setdefault("full_inductor_compilation", {})
    report["compiled_blocks"] = report.get("compiled_blocks", 0) + compiled
    report["block_pieces"] = report.get("block_pieces", 0) + pieces
    report["layers"] = report.get("layers", 0) + (block_count(gm) if ctx.stage != "backward" else 0)
    if plan is None:
        return _compile_whole(gm, ctx)
    return Compiled(plan.compile(ctx, _compile_whole), gm)


def _ops(gm: fx.GraphModule) -> int:
    return sum(node.op == "call_function" for node in gm.graph.nodes)


def _reusable_plan(gm: fx.GraphModule, ctx: PassContext) -> PiecePlan | None:
    """The pieces of a graph whose blocks are compiled once each (`--compile.block_reuse` on); None
    where the graph is compiled whole. Inductor's time grows with the ops it lowers, plus a cost
    per graph: the pieces are compiled where the distinct ones hold at most half the step's ops. (On
    CPU, llama3 debugmodel at 12 layers, dp_shard 2: 10 distinct pieces holding most of the ops
    compiled in 140 s, the whole step in 83 s, 22 distinct pieces, most of them communication, in
    72 s.) Where workers are lent to several graphs (a pipeline rank's stages: `compile_workers.lent`),
    always the pieces: the workers compile them at once, and a block compiled for one stage serves the
    rank's others (8B cut to 16 layers, Interleaved1F1B on 2 H200s: each rank's four graphs of 4-5
    blocks were compiled whole, one after another, 24.7 s)."""
    if ctx.stage == "joint" or not (ctx.cfg is None or ctx.cfg.compile.block_reuse):
        return None
    plan = plan_pieces(gm, None if ctx.stage == "train_step" else ctx.stage)
    if plan is None or compile_workers.lending():
        return plan
    return plan if 2 * sum(_ops(members[0].module) for members in plan.groups) <= _ops(gm) else None


KEEP_TRAIN_STEP_ORDER = {"reorder_for_locality": False, "reorder_for_peak_memory": False}
"""Inductor options for the one train-step graph (forward, loss and backward): its order is the
schedule, and Inductor's two reorderings, made for a forward or a backward graph alone, undo it.
`reorder_for_locality` moves each graph output's producer next to the output, so every gradient's
reduce-scatter is waited on, and its unsharded input freed, only when the step returns;
`reorder_for_peak_memory`, the scheduler's list scheduling that then wins its peak estimate, starts
whatever has no input made by the step as early as it can: parameter all-gathers of later blocks,
and the casts of the shards that backward gathers again (activation checkpointing, resharding),
which then stay live across the loss. On llama3 debugmodel (8 blocks, full AC, dp_shard 2, bf16)
the compiled step held 14.4 MiB across the loss with them, 5.4 MiB without (the traced graph 4.6)
and peaked at 17.7 MiB instead of 11.7; in llama3 70B the casts alone are a bf16 copy of every
block's shard (4 GiB at dp_shard 32). A backend that schedules the collectives (autoparallel)
needs its order kept as well."""


ONE_CONFIG_PER_KERNEL = {"triton.autotune_pointwise": False, "test_configs.force_filter_reduction_configs": True}
"""Inductor options for every graph the full compile compiles: one launch configuration per pointwise and per
reduction kernel, none benchmarked. standalone_compile autotunes every kernel at compile time, compiling each
candidate configuration in the process's small Triton pool and running it, and before each run Inductor copies the
buffers the kernel writes to host memory and back. Pointwise kernels read and write each element once, bound by
memory bandwidth whichever block size runs them; a reduction keeps the configuration Inductor's deterministic mode
keeps (its `force_filter_reduction_configs`, the filter alone, without the rest of that mode). On one H200 (torch
2.11, llama3 8B as rank 0 of dp_shard 8), pointwise alone: the compile workers' part of the first step 3.3-3.8 s
against 4.3-4.5 s with the choice benchmarked, median tokens/s of steps 4-9 9,287-9,334 against 9,273-9,319
(torchtitan compile 9,286-9,329; bench/results/2026-12-01-session31, call 5); reductions too, in two calls of four
rounds against pointwise alone: the workers' part 0.3 s shorter on average in each call (3.0-5.6 s against 3.8-5.2),
launch to step 1 1.1 and 0.2 s shorter on average, median tokens/s 9,418-9,498 against 9,411-9,557 (torchtitan
compile 9,393-9,456; 2026-12-01-session32, calls 1-2). First made for the in-graph update alone, whose output projection's piece
took a compile worker 5.4-6.1 s (2026-11-30-session28, calls 1-3)."""


def _options(ctx: PassContext) -> dict:
    # standalone_compile hands `options` to compile_fx as keywords (torch 2.11 and 2.13).
    return {"config_patches": {**(KEEP_TRAIN_STEP_ORDER if ctx.stage == "train_step" else {}), **ONE_CONFIG_PER_KERNEL}}


def warm_compile_pool(device: torch.device) -> None:
    """Start Inductor's pool of Triton compile processes now, before the step is traced: each imports torch,
    seconds that the first compile would otherwise wait (on 4 H200s a step's first compile, one op, took
    1.8-3.0 s, later pieces of a few ops 0.2-0.5 s). torch.compile starts it when its backend is made, before
    dynamo traces. `TORCH_WARM_POOL=0` turns it off, as for torch.compile."""
    if device.type == "cuda":
        from torch._inductor.async_compile import maybe_warm_pool

        maybe_warm_pool()


def compile_graph(gm: fx.GraphModule, inputs: list[Any], options: dict | None) -> Any:
    """Inductor's compile of `gm` (decomposed) on fake `inputs`: standalone_compile's artifact."""
    # Under no_grad AOTAutograd inside Inductor compiles an inference graph: the backward is already in it.
    # The fake mode comes from the inputs: "from_graph" reads it off the outputs, which fails on an
    # AOTAutograd backward graph whose outputs include None (inputs without a gradient).
    with torch.no_grad(), tracing(TracingContext(compile_cache.fake_mode_of(inputs) or detect_fake_mode(inputs))):
        return standalone_compile(gm, inputs, dynamic_shapes="from_tracing_context", options=options)


def _compile_whole(gm: fx.GraphModule, ctx: PassContext) -> Compiled:
    """Compile `gm` with Inductor, or load its compile from the job's compile cache (compile_cache.py);
    a piece's entry is the one its decomposition looked up (`PieceEntry`), which a compile worker may
    have filled this start (counted as a miss and a write, as if compiled here)."""
    entry: PieceEntry | None = gm.meta.get(_ENTRY)
    inputs = fake_inputs(gm, ctx)
    kept = _drop_unused_opaque_inputs(gm)
    # a piece's inputs are all tensors (block_compile.split): none is dropped, the entry's convention holds
    assert entry is None or kept is None, "a piece lost an input"
    if kept is not None:
        inputs = [inputs[i] for i in kept]
    options = entry.options if entry is not None else _options(ctx)
    cache = _cache(ctx)
    compiled, outcome, by_worker = None, "off", False
    if cache is not None:
        key, parts = (entry.key, entry.parts) if entry is not None else compile_cache.cache_key(gm, inputs, options, ctx.device, ctx.meshes)
        try:
            compiled = entry.artifact if entry is not None and entry.artifact is not None else cache.load(key)
            by_worker = compiled is not None and entry is not None and entry.by_worker
            outcome = "hit" if compiled is not None and not by_worker else "miss"
        except compile_cache.Refused as e:
            logger.warning(f"compile cache: entry {cache.path(key)} refused ({e}); compiling afresh")
            outcome = f"refused ({e})"
    written = int(by_worker)
    start = time.perf_counter()
    if compiled is None:
        if entry is not None and not entry.decomposed:
            gm = decompose(gm, inputs)
        cacheable = compile_cache.cacheable_inputs(inputs)
        if cacheable is None and cache is not None:
            logger.warning("compile cache: the graph's inputs hold fake tensors it cannot give a cacheable fake mode; "
                           "compiling without the cache")
            outcome, cache = "refused (inputs not cacheable)", None
        compiled = compile_graph(gm, cacheable if cacheable is not None else inputs, options)
        if cache is not None:
            written = int(cache.store(key, compiled, parts))
    if cache is not None:
        made = "stored by a compile worker in" if by_worker else "stored in" if written else "entry"
        logger.info(f"compile cache: {outcome}, {made} {cache.path(key)} ({_ops(gm)} ops, {time.perf_counter() - start:.1f} s)")
    compile_cache.record(ctx.report, outcome, int(outcome == "hit"), written)
    held = key if cache is not None and (outcome == "hit" or written) else None
    if kept is None:
        return Compiled(compiled, gm, cache_key=held)
    return Compiled(lambda *args: compiled(*[args[i] for i in kept]), gm)


def _without_mark(node: fx.Node) -> None:
    custom = node.meta.get("custom")
    if custom and REGION_KEY in custom:
        node.meta["custom"] = {k: v for k, v in custom.items() if k != REGION_KEY}


def unmark_subgraphs(gm: fx.GraphModule) -> None:
    """Clear the region mark inside the subgraphs a higher-order op calls (FlexAttention's score and
    mask functions): Inductor compiles them as part of that op. torch 2.11's regional_inductor would
    also make each of them a compiled region of its own, a boxed callable the op then calls with the
    wrong arguments."""
    for node in gm.graph.find_nodes(op="get_attr"):
        sub = getattr(gm, node.target)
        if isinstance(sub, fx.GraphModule):
            for inner in sub.graph.nodes:
                _without_mark(inner)
            unmark_subgraphs(sub)


def regional_inductor_pass(gm: fx.GraphModule, ctx: PassContext) -> Compiled:
    """Compile each marked region with Inductor; everything else keeps running as FX.

    Collectives leave the regions first: outside, they run asynchronously with their wait where the
    graph (and the bucketing passes before this one) put it; inside a compiled region they would be
    waited on within it.
    """
    unmark_subgraphs(gm)
    marked = 0
    for node in gm.graph.nodes:
        custom = node.meta.get("custom")
        if custom and REGION_KEY in custom:
            if is_collective(node):
                _without_mark(node)
            else:
                marked += 1
    if not marked:
        raise RuntimeError(
            "regional_inductor found no op marked for Inductor in the graph: mark the model with "
            "graph_trainer.regions.annotate_regions before it is traced, or use --compile.inductor_compilation full"
        )
    inputs = fake_inputs(gm, ctx)
    # The regions are compiled with the dynamic-shape facts of the ambient tracing context: ours has
    # the graph's fake mode, whose shapes are static.
    with torch.no_grad(), tracing(TracingContext(detect_fake_mode(inputs))):
        compiled = regional_inductor(gm, *inputs)
    return Compiled(compiled, compiled, boxed=True)


register_pass(PassSpec(
    name="inductor_decomposition",
    description="retrace the graph with Inductor's decomposition table (every node in Inductor's op set)",
    # Not the aot joint graph: a retrace flattens its (primals, tangents) inputs into plain
    # placeholders, and the partitioner, which finds tangents by name, would put them in forward.
    stages=("forward", "backward", "train_step"),
    modes=GRAPH_MODES,
    fn=inductor_decomposition,
    lowers=True,
    waits=True,
))

register_pass(PassSpec(
    name="full_inductor_compilation",
    description="compile the whole graph (collectives included) with Inductor",
    stages=("forward", "backward", "train_step"),
    modes=GRAPH_MODES,
    fn=full_inductor_compilation,
    requires=("inductor_decomposition",),
    compiles=True,
))

register_pass(PassSpec(
    name="regional_inductor",
    description="compile only the regions the model marks (graph_trainer/regions.py) with Inductor",
    stages=("forward", "backward", "train_step"),
    modes=GRAPH_MODES,
    fn=regional_inductor_pass,
    conflicts=("full_inductor_compilation",),
    compiles=True,
))
