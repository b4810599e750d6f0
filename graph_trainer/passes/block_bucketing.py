"""transformer_block_bucketing: one all-gather bucket and one reduce-scatter bucket per transformer
block, FSDP-style, and one all-reduce bucket of the block's replicated parameters' gradients (DDP, or
the parameters auto placement keeps whole).

A collective's block comes from its parameter's FQN (`...layers.<i>...`): the leading graph inputs
are the parameters in `ctx.param_fqns` order, an all-gather belongs to the parameter it gathers and a
gradient reduction to the output it produces (outputs are (loss, *grads)). Parameters outside
the blocks (embedding, final norm, output projection) are bucketed by maximal runs in the order they
are used, so they never join a block's; under a memory budget their gradients are reduced one by one
(a bucket copies the output projection's fp32 gradient beside itself: `bucket_plan.frees_early`). A
block used in both forward and
backward (parameters gathered again for backward by reshard_after_forward or activation
checkpointing) gets one all-gather bucket in each.

Schedule: a block's all-gather is issued where the all-gather `depth` blocks earlier is first used
(prefetch of `depth` blocks; 1: the next block gathers while the current one computes); `depth` is
chosen by the cost model's simulated step time (on the link figures measured at start-up on a real
multi-GPU job, parallel/links.py), among the depths whose gathered bytes in flight stay within the
hardware's `max_in_flight_bytes`, the smallest on ties (least memory). A block's gradient
reduction is issued as soon as its last gradient exists and waited for when the next reduction of its kind is
issued (at most two in flight), the last one at the end; under a memory budget one outside the blocks is waited for
where the cost model expects it done, by the next block's at the latest (its buffer, 1.96 GiB fp32 for llama3 8B's
output projection, is freed inside the first backward block). `autoparallel_scheduling` plans a step of blocks the
same way.

torch's `manual_overlap_bucketing` does the same from module FQNs, but finds a module's nodes through
`nn_module_stack` metadata, which make_fx train-step graphs do not carry.
"""

from __future__ import annotations

from torch import fx

from .bucket_plan import block_plans, frees_early, layout
from .bucketing import schedule
from .collectives import find_collectives
from .cost_model import CostModel
from .registry import PassContext, PassSpec, register_pass

def transformer_block_bucketing(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    colls = find_collectives(gm)
    if not colls:
        return gm
    model = CostModel.for_context(ctx)
    lay = layout(gm, colls, model)
    plans = block_plans(gm, colls, list(ctx.param_fqns[: ctx.num_params]), lay, model, frees_early(ctx.cfg))
    (_, depth), buckets = min(plans, key=lambda p: p[0])
    ctx.report.setdefault("transformer_block_bucketing", {})["prefetch_blocks"] = depth
    return schedule(gm, buckets, lay, model, "transformer_block_bucketing")


register_pass(PassSpec(
    name="transformer_block_bucketing",
    description="one all-gather, one reduce-scatter and one all-reduce bucket per transformer block (layers.<i>), "
                "non-block parameters in their own; all-gathers prefetched 1-3 blocks ahead (cost model)",
    stages=("train_step",),
    modes=("aot_fx_trace",),
    fn=transformer_block_bucketing,
    conflicts=("auto_bucketing", "autoparallel_scheduling"),
    excluded_backends=("autoparallel_backend",),
))
