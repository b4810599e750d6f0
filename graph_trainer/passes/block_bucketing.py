"""transformer_block_bucketing: one all-gather bucket and one reduce-scatter bucket per transformer
block, FSDP-style.

A collective's block comes from its parameter's FQN (`...layers.<i>...`): the leading graph inputs
are the parameters in `ctx.param_fqns` order, an all-gather belongs to the parameter it gathers and a
gradient reduce-scatter to the output it produces (outputs are (loss, *grads)). Parameters outside
the blocks (embedding, final norm, output projection) are bucketed by maximal runs in the order they
are used, so they get their own buckets and never join a block's. A block used in both forward and
backward (parameters gathered again for backward by reshard_after_forward or activation
checkpointing) gets one all-gather bucket in each.

Schedule (fixed, not cost-driven): the next block's all-gather is issued where the current block's
first all-gathered parameter is used, i.e. before the current block computes (prefetch of one block);
a block's gradient reduce-scatter is issued as soon as its last gradient exists and waited for when
the next block's reduce-scatter is issued (at most two in flight), the last one at the end.

torch's `manual_overlap_bucketing` does the same from module FQNs, but finds a module's nodes through
`nn_module_stack` metadata, which make_fx train-step graphs do not carry.
"""

from __future__ import annotations

import re

from torch import fx

from .bucket_plan import Bucket, layout
from .bucketing import schedule
from .collectives import Collective, find_collectives
from .cost_model import CostModel
from .registry import PassContext, PassSpec, register_pass

_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def block_of(fqn: str) -> int | None:
    match = _BLOCK.search(fqn)
    return int(match.group(1)) if match else None


def _param_index(c: Collective, placeholders: dict[fx.Node, int], num_params: int) -> int | None:
    if c.kind == "all_gather":
        index = placeholders.get(c.placeholder)
    else:
        index = None if c.output_index is None else c.output_index - 1
    return index if index is not None and 0 <= index < num_params else None


def block_buckets(gm: fx.GraphModule, colls: list[Collective], fqns: list[str]) -> list[Bucket]:
    """Collectives grouped by (kind, block or run of non-block parameters, collective key)."""
    placeholders = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    buckets: list[Bucket] = []
    for kind, order_by in (("all_gather", "need"), ("reduce_scatter", "ready")):
        groups: dict[tuple, list[Collective]] = {}
        run, previous_block = 0, -1
        for c in sorted((c for c in colls if c.kind == kind), key=lambda c: getattr(c, order_by)):
            index = _param_index(c, placeholders, len(fqns))
            block = block_of(fqns[index]) if index is not None else None
            if block is None and previous_block is not None:
                run += 1
            previous_block = block
            groups.setdefault((c.key, "block" if block is not None else "rest", block if block is not None else run), []).append(c)
        buckets += [Bucket(members) for members in groups.values()]
    return buckets


def place_per_block(buckets: list[Bucket]) -> None:
    gathers = sorted((b for b in buckets if b.kind == "all_gather"), key=lambda b: b.need)
    for k, b in enumerate(gathers):
        b.issue = max(b.ready, gathers[k - 1].need) if k else b.ready
        b.wait = b.need
    scatters = sorted((b for b in buckets if b.kind == "reduce_scatter"), key=lambda b: b.ready)
    for k, b in enumerate(scatters):
        b.issue = b.ready
        b.wait = scatters[k + 1].ready if k + 1 < len(scatters) else max(m.need for m in b.members)


def transformer_block_bucketing(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    colls = find_collectives(gm)
    if not colls:
        return gm
    model = CostModel.for_context(ctx)
    lay = layout(gm, colls, model)
    buckets = block_buckets(gm, colls, list(ctx.param_fqns[: ctx.num_params]))
    place_per_block(buckets)
    return schedule(gm, buckets, lay, model, "transformer_block_bucketing")


register_pass(PassSpec(
    name="transformer_block_bucketing",
    description="one all-gather and one reduce-scatter bucket per transformer block (layers.<i>), "
                "non-block parameters in their own; prefetch the next block's all-gather",
    stages=("train_step",),
    modes=("aot_fx_trace",),
    fn=transformer_block_bucketing,
    conflicts=("auto_bucketing", "autoparallel_scheduling"),
    excluded_backends=("autoparallel_backend",),
))
