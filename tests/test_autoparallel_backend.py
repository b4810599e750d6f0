"""autoparallel_backend: its pass list, its cost-model schedule (on llama3 debugmodel's train step
traced in this process on a fake 2-rank process group), the refusal of `--compile.autoparallel_impl
meta` without Meta's package, and training under torchrun with full Inductor like eager."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers import cached_run, losses, read_metrics
from test_bucketing import LAYERS, PARAMS, counts, fake_pg, trace_llama  # noqa: F401  (fake_pg is a fixture)

import graph_trainer.backends.autoparallel as ap
from graph_trainer.backends import backend_names, get_backend
from graph_trainer.config import ConfigError, parse_args
from graph_trainer.passes.bucket_plan import BUCKET_SCALES, estimate, layout, place, saturating_cap, size_runs
from graph_trainer.passes.bucketing import SCHEDULE_META
from graph_trainer.passes.collectives import find_collectives
from graph_trainer.passes.cost_model import CostModel
from graph_trainer.passes.registry import apply_passes

OWN = ["autoparallel_scheduling", "inductor_decomposition", "full_inductor_compilation"]
GATHER_GROUP = ["separate_gather_group"]
"""What a 2-rank aot_fx_trace job runs by default before the backend's own passes (defaults.py): the
all-gathers on their own communicator; the backend's scheduling does the bucketing."""


def test_pass_list():
    assert "autoparallel_backend" in backend_names()
    backend = get_backend("autoparallel_backend")
    assert backend.pass_names([]) == OWN
    # a user graph pass runs before scheduling; a pass the backend runs is taken once; cudagraph stays last
    assert backend.pass_names(["autoparallel_scheduling", "user_graph_pass", "cudagraph"]) == ["user_graph_pass", *OWN, "cudagraph"]


def test_validator_accepts_the_backend_and_refuses_a_second_scheduler():
    from graph_trainer.passes.validate import check_passes

    cfg = parse_args(["--compile.mode", "aot_fx_trace", "--compile.inductor_compilation", "autoparallel_backend"])
    check_passes(cfg, "cpu")
    cfg = parse_args(["--compile.mode", "aot_fx_trace", "--compile.inductor_compilation", "autoparallel_backend",
                      "--compile.passes", "transformer_block_bucketing"])
    with pytest.raises(ConfigError, match="cannot run with --compile.inductor_compilation autoparallel_backend"):
        check_passes(cfg, "cpu")


def test_meta_impl_without_the_package_is_a_one_line_config_error(monkeypatch):
    monkeypatch.setattr(ap, "meta_autobucketing", lambda: None)
    cfg = parse_args(["--compile.mode", "aot_fx_trace", "--compile.inductor_compilation", "autoparallel_backend",
                      "--compile.autoparallel_impl", "meta"])
    with pytest.raises(ConfigError) as err:
        ap.check_config(cfg)
    message = str(err.value)
    assert "\n" not in message
    assert "pip install git+https://github.com/meta-pytorch/autoparallel@da99589" in message
    assert "--compile.autoparallel_impl builtin" in message
    ap.check_config(parse_args(["--compile.inductor_compilation", "autoparallel_backend"]))


def test_a_step_of_blocks_is_scheduled_one_bucket_per_block(fake_pg):
    """On a step of transformer blocks the schedule is transformer_block_bucketing's: the size search chose 130
    all-gather buckets for the auto-placed 8B cut to 16 layers, priced 0.7% faster than the per-block plan and 2.4%
    slower on 2 H200s (bench/results/2026-11-30-session24, calls 2 and 8)."""
    gm, ctx = trace_llama("--parallelism.reshard_after_forward", "always")
    gm = apply_passes(gm, ["reshard_after_forward", "autoparallel_scheduling"], ctx, "train_step")
    # forward: 6 blocks + [tok_embeddings] + [norm, output]; backward: 6 blocks + [norm, output]
    assert counts(gm) == {"all_gather": 2 * LAYERS + 3, "reduce_scatter": LAYERS + 2}


def test_a_step_without_blocks_gets_the_bucket_size_with_the_lowest_simulated_step(fake_pg):
    gm, ctx = trace_llama("--parallelism.reshard_after_forward", "always")
    gm = apply_passes(gm, ["reshard_after_forward"], ctx, "train_step")
    # the same parameters under names that are not transformer blocks (`layers.<i>`)
    ctx = dataclasses.replace(ctx, param_fqns=[f.replace("layers.", "stack_") for f in ctx.param_fqns])
    model = CostModel.for_context(ctx, fused=True)
    colls = find_collectives(gm)
    lay = layout(gm, colls, model)
    candidates = []
    for scale in BUCKET_SCALES:
        buckets = size_runs(colls, saturating_cap(model, scale))
        place(buckets, lay, model)
        candidates.append(estimate(buckets, lay, model).step_s)
    gm = apply_passes(gm, ["autoparallel_scheduling"], ctx, "train_step")
    plan = gm.meta[SCHEDULE_META]
    assert plan["estimated_step_s"] == pytest.approx(min(candidates))
    assert plan["estimated_step_s"] < plan["unscheduled_step_s"]
    assert plan["estimated_exposed_comm_s"] < plan["unscheduled_exposed_comm_s"]
    got = counts(gm)
    assert got["all_gather"] < PARAMS and got["reduce_scatter"] < PARAMS


def test_schedule_without_reshard_gathers_each_block_once(fake_pg):
    gm, ctx = trace_llama("--parallelism.reshard_after_forward", "never")
    gm = apply_passes(gm, ["reshard_after_forward", "autoparallel_scheduling"], ctx, "train_step")
    assert counts(gm) == {"all_gather": LAYERS + 2, "reduce_scatter": LAYERS + 2}


SMALL = ("--training.steps", "5", "--training.batch_size", "2", "--training.seq_len", "64", "--metrics.log_freq", "1")
DP2 = ("--parallelism.dp_shard", "2")
EAGER = ("--compile.mode", "eager")
"""The reference runs say so: the default mode is aot_fx_trace."""


@pytest.mark.slow
def test_trains_like_eager_with_full_inductor():
    eager = read_metrics(cached_run((*SMALL, *DP2, *EAGER), 2))
    folder = cached_run((*SMALL, *DP2, "--compile.mode", "aot_fx_trace", "--compile.inductor_compilation",
                         "autoparallel_backend", "--compile.dump_graphs"), 2)
    compiled = read_metrics(folder)
    assert len(compiled) == 5
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-4)
    stages = {s["stage"]: s for s in json.loads((folder / "graphs" / "summary.json").read_text())["stages"]}
    assert list(stages) == ["traced", "reshard_after_forward", "recompute_pointwise", *GATHER_GROUP, *OWN]
    assert stages["full_inductor_compilation"]["compiled"] is True
    gathers = {name: stages[name]["collectives"]["all_gather"]["count"] for name in ("traced", "reshard_after_forward", OWN[0])}
    assert gathers["traced"] == PARAMS
    # the default policy gathers every parameter that backward reads again but the final norm and output
    # (2; the embedding's gradient does not read it); scheduling buckets those 111 gathers per block: forward's
    # 6 blocks, [tok_embeddings] and [norm, output], backward's 6 blocks
    assert gathers["reshard_after_forward"] == PARAMS + (PARAMS - 1) - 2
    assert gathers["autoparallel_scheduling"] == 2 * LAYERS + 2
    scheduled = stages["autoparallel_scheduling"]["collectives"]
    assert scheduled["all_gather"]["buckets"] > 0
    assert scheduled["reduce_scatter"]["count"] < PARAMS


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="Meta's scheduler is torch's CUDA overlap scheduler; needs 2 GPUs")
def test_meta_impl_trains_like_eager():
    reason = f"Meta's autoparallel is not installed: {ap.META_AUTOPARALLEL_INSTALL}"
    pytest.importorskip("autoparallel", reason=reason)
    if ap.meta_autobucketing() is None:  # PyPI's unrelated `autoparallel` imports too
        pytest.skip(reason)
    eager = read_metrics(cached_run((*SMALL, *DP2, *EAGER), 2))
    folder = cached_run((*SMALL, *DP2, "--compile.mode", "aot_fx_trace", "--compile.inductor_compilation",
                         "autoparallel_backend", "--compile.autoparallel_impl", "meta"), 2)
    assert losses(read_metrics(folder)) == pytest.approx(losses(eager), rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("mode, placement", [("aot", "auto"), ("aot_fx_trace", "auto")])
def test_trains_like_eager_in_aot_and_with_auto_placement(mode, placement):
    """aot runs the backend's schedule and Inductor on the partitioned forward and backward graphs (the solver's
    placements there: SimpleFSDP's train with the backend in aot_fx_trace above, and aot's path does not depend
    on who placed the parameters)."""
    eager = read_metrics(cached_run((*SMALL, *DP2, *EAGER), 2))
    auto = ("--compile.autoparallel",) if placement == "auto" else ()
    folder = cached_run((*SMALL, *DP2, *auto, "--compile.mode", mode, "--compile.inductor_compilation",
                         "autoparallel_backend", "--compile.dump_graphs"), 2)
    assert losses(read_metrics(folder)) == pytest.approx(losses(eager), rel=1e-4)
    stages = [s["stage"] for s in json.loads((folder / "graphs" / "summary.json").read_text())["stages"]]
    if mode == "aot":
        # resharding tags the joint graph for the partitioner; the backend's passes run on its two graphs
        assert stages == ["joint", "joint_reshard_after_forward",
                          *[f"{graph}{suffix}" for graph in ("forward", "backward") for suffix in ["", *(f"_{p}" for p in OWN)]]]
    else:
        assert stages == ["traced", "reshard_after_forward", "recompute_pointwise", *GATHER_GROUP, *OWN]
    if placement == "auto":
        # The run trained with the solver's placements, not SimpleFSDP's: placements.json names every
        # parameter, and the small final norm is replicated over dp_shard where SimpleFSDP shards it.
        placed = json.loads((folder / "placements.json").read_text())
        manual = json.loads((cached_run((*SMALL, *DP2, *EAGER), 2) / "placements.json").read_text())
        assert set(placed) == set(manual)
        dim = placed["norm.weight"]["mesh_dim_names"].index("dp_shard")
        assert manual["norm.weight"]["placements"][dim] == "Shard(dim=0)"
        assert placed["norm.weight"]["placements"][dim] == "Replicate()"
