"""The collective scheduling passes on a traced graph: both find the FSDP collectives
(collectives.py), plan on the same cost model (bucket_plan.py, cost_model.py) and rewrite the graph
with the same merge (bucket_merge.py).
- `auto_bucketing`: each bucket grows, in the order the collectives are needed, until the alpha-beta
  model says it is bandwidth-bound (its latency term at most 10% of its time), then every bucket is
  placed to overlap compute (see `bucket_plan.place`).
- `autoparallel_scheduling` (the autoparallel backend's step): on a train step of transformer blocks,
  one bucket per block (as `transformer_block_bucketing`), the prefetch depth chosen by the simulated
  step time with compute estimated as Inductor will run it (fused pointwise ops), since the backend
  compiles the whole graph afterwards; on other graphs the bucket size is chosen among multiples of
  the saturating size by the same simulation. It weighed the two kinds of plan against each other
  until the model priced the size-based buckets of the auto-placed 8B cut to 16 layers 0.7% faster
  than the per-block ones, where on 2 H200s the same placement ran 2.4% slower with them
  (bench/results/2026-11-30-session24: call 2; call 8's profile, 18.4 ms exposed against call 2's
  8.3); the model's error between plans this close is larger than their difference.
"""

from __future__ import annotations

import logging

from torch import fx

from ..config import ConfigError
from .bucket_merge import rewrite
from .bucket_plan import Bucket, Layout, block_of, block_plans, choose_buckets, estimate, frees_early, layout, saturating_plan
from .bucketing_compat import META_AUTOPARALLEL_INSTALL, meta_autobucketing
from .collectives import KINDS, find_collectives
from .cost_model import CostModel
from .registry import GRAPH_MODES, PassContext, PassSpec, register_pass

logger = logging.getLogger("graph_trainer")

SCHEDULE_META = "collective_schedule"
"""gm.meta key: what the last scheduling pass planned (buckets, estimated times), for logs and tests."""


def schedule(gm: fx.GraphModule, buckets: list[Bucket], lay: Layout, model: CostModel, name: str) -> fx.GraphModule:
    """Estimate, record and rewrite a placed plan."""
    before = estimate([Bucket([m], *m.at) for b in buckets for m in b.members], lay, model)
    after = estimate(buckets, lay, model)
    counts = {k: sum(1 for b in buckets if b.kind == k) for k in KINDS}
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
        f"{name}: {gm.meta[SCHEDULE_META]['collectives_before']} collectives -> {counts['all_gather']} all-gather, "
        f"{counts['reduce_scatter']} reduce-scatter and {counts['all_reduce']} all-reduce buckets; estimated step {after.step_s * 1e3:.2f} ms "
        f"({after.exposed_comm_s * 1e3:.2f} ms exposed comm) vs {before.step_s * 1e3:.2f} ms "
        f"({before.exposed_comm_s * 1e3:.2f} ms) unbucketed, on the {model.hw.name} model"
    )
    rewrite(gm, buckets, lay)
    return gm


def auto_bucketing(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    model = CostModel.for_context(ctx)
    buckets, lay = saturating_plan(gm, model)
    if not buckets:
        return gm
    return schedule(gm, buckets, lay, model, "auto_bucketing")


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
    fqns = list(ctx.param_fqns[: ctx.num_params])
    if ctx.stage == "train_step" and any(block_of(f) is not None for f in fqns):
        _, buckets = min(block_plans(gm, colls, fqns, lay, model, frees_early(ctx.cfg)), key=lambda p: p[0])
    else:
        buckets = choose_buckets(colls, lay, model)
    return schedule(gm, buckets, lay, model, "autoparallel_scheduling")


_BUCKETING = ("auto_bucketing", "transformer_block_bucketing", "autoparallel_scheduling")

register_pass(PassSpec(
    name="auto_bucketing",
    description="bucket FSDP all-gathers/reduce-scatters and gradient all-reduces to the alpha-beta model's bandwidth-saturating "
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
