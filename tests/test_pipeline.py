"""Pipeline parallelism (`--parallelism.pp`): the stage split, parity with pp 1, resume across pp degrees,
and the up-front refusals.

Parity is bitwise: a pp run's schedule microbatches are the microbatches of a pp 1 run with as many
gradient-accumulation steps (same data, same loss scaling, gradients added in the same order), and the
gradient norm reduces every stage's per-tensor norms as pp 1 reduces the whole model's.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from helpers import cached_run, cached_train, grad_norms, launch, losses, run_train

from graph_trainer import cli, models
from graph_trainer.config import parse_args
from graph_trainer.metrics import read_metrics
from graph_trainer.parallel.pipeline import balanced_counts, build_layout, prune_to_rank, split_layers, stage_views

BASE = ("--model.n_layers", "4", "--training.batch_size", "4", "--training.seq_len", "64", "--training.steps", "3",
        "--lr_scheduler.warmup_steps", "1")
CKPT = ("--checkpoint.enable", "--checkpoint.interval", "2")
REFERENCE = (*BASE, *CKPT, "--compile.mode", "eager", "--training.gradient_accumulation_steps", "4")
"""pp 1 with the four microbatches every pp run below splits its batch into."""


def _pp(schedule: str, mode: str, *extra: str) -> tuple[str, ...]:
    return (*BASE, "--parallelism.pp", "2", "--parallelism.pp_schedule", schedule, "--parallelism.pp_microbatches", "4",
            "--compile.mode", mode, *extra)


def _same(records: list[dict], reference: list[dict]) -> None:
    assert len(records) == len(reference)
    assert losses(records) == losses(reference)
    assert grad_norms(records) == grad_norms(reference)


def test_even_and_explicit_splits():
    assert split_layers(4, 2, None) == ((0, 1), (2, 3))
    assert split_layers(4, 2, [1, 3]) == ((0,), (1, 2, 3))
    with pytest.raises(ValueError, match="do not split evenly"):
        split_layers(5, 2, None)
    with pytest.raises(ValueError, match="add up"):
        split_layers(4, 2, [1, 2])


def _loads(counts: list[int], layer: float, output: float, pp: int) -> tuple[list[float], list[float]]:
    stages = [n * layer for n in counts]
    stages[-1] += output
    return [sum(stages[r::pp]) for r in range(pp)], stages


def test_balanced_split_weighs_the_output_projection():
    """llama3 8B cut to 16 layers at 4096 tokens: per layer 1.51 GFLOP a token, the output projection 3.15, 2.09 layers
    (the whole model's count is torchtitan's). At pp 2 the even split (8, 8) leaves the first stage idle for a fifth of the
    last one's work: balanced is (9, 7). Interleaved over 4 stages (stages 0 and 2 on rank 0), torchtitan's split
    (4, 5, 4, 3) loads the ranks with 8 and 10.1 layers' work and its last stage with 5.1; balanced, (4, 5, 5, 2), with
    9 and 9.1, no stage over 5."""
    cfg = parse_args(["--model.flavor", "8B", "--model.n_layers", "16", "--training.seq_len", "4096"])
    spec = models.get_spec(cfg.model.name)
    args = spec.job_args(cfg)
    model = models.build_on_meta(spec, args, "cpu")
    layers, embedding, output = models.stage_costs(args, model, 4096)
    assert sum(layers) + embedding + output == models.nparams_and_flops_per_token(args, model, 4096)[1]
    assert len(set(layers)) == 1 and embedding == 0 and round(output / layers[0], 2) == 2.09
    assert balanced_counts(layers, embedding, output, 2, 2) == [9, 7]
    interleaved = balanced_counts(layers, embedding, output, 2, 4)
    ranks, stages = _loads(interleaved, layers[0], output, 2)
    titan_ranks, titan_stages = _loads([4, 5, 4, 3], layers[0], output, 2)
    assert interleaved == [4, 5, 5, 2] and max(ranks) < 0.91 * max(titan_ranks) and max(stages) < max(titan_stages)
    # equal layers and no edge cost: the even split
    assert balanced_counts([1.0] * 16, 0.0, 0.0, 2, 4) == [4, 4, 4, 4]


def test_balanced_split_of_deepseek_counts_active_experts():
    """DeepSeek V3 16B: a MoE layer's active work (router, shared expert, 6 of its 64 routed experts) is 0.62 GFLOP a
    token, a bit more than the dense first layer's 0.61; counted over all 64 experts it would be 3.5. The output
    projection weighs two layers, so 6 layers over 2 stages split (4, 2)."""
    cfg = parse_args(["--model.name", "deepseek_v3", "--model.flavor", "16B", "--model.n_layers", "6", "--training.seq_len", "4096"])
    spec = models.get_spec(cfg.model.name)
    args = spec.job_args(cfg)
    model = models.build_on_meta(spec, args, "cpu")
    layers, embedding, output = models.stage_costs(args, model, 4096)
    assert sum(layers) + embedding + output == models.nparams_and_flops_per_token(args, model, 4096)[1]
    assert layers[0] < layers[1] == layers[5] < 1.05 * layers[0]
    assert balanced_counts(layers, embedding, output, 2, 2) == [4, 2]


@pytest.mark.slow
def test_balanced_pp2_of_five_layers_equals_pp1_bitwise():
    """5 layers do not split evenly; `balanced` gives the first stage 3 (the last also runs the output) and trains
    as pp 1 does, bit for bit. The step-1 record says the split."""
    layers = ("--model.n_layers", "5")
    records = cached_train((*_pp("1F1B", "eager"), *layers, "--parallelism.pp_layers_per_stage", "balanced"), nproc=2)
    assert records[0]["pp_stage_layers"] == "3,2"
    _same(records, cached_train((*BASE, *layers, "--compile.mode", "eager", "--training.gradient_accumulation_steps", "4")))


def test_stages_keep_the_whole_models_fqns():
    """Each rank's module holds its stages under the whole model's FQNs; together the ranks hold each once."""
    cfg = parse_args(["--model.n_layers", "4"])
    spec = models.get_spec(cfg.model.name)
    args = spec.job_args(cfg)
    whole = set(models.build_on_meta(spec, args, "cpu").state_dict())
    layout = build_layout(2, "Interleaved1F1B", 0, 0, [], args.n_layers)
    assert layout.num_stages == 4 and layout.microbatches == 4 and layout.stages_of(1) == (1, 3) and layout.last_rank == 1
    held = []
    for rank in range(2):
        model = prune_to_rank(models.build_on_meta(spec, args, "cpu"), layout, rank)
        held.append(set(model.state_dict()))
        views = stage_views(model, layout, rank)
        assert [sorted(v.layers.keys()) for v in views] == [[str(i) for i in layout.layers[s]] for s in layout.stages_of(rank)]
        assert set().union(*(v.state_dict() for v in views)) == held[-1]
    assert held[0] | held[1] == whole and not held[0] & held[1] - {k for k in whole if "freqs" in k}
    assert "tok_embeddings.weight" in held[0] and "output.weight" in held[1]


# Each schedule once and 1F1B in both modes (a run costs 20-40 s on CI's two cores): the traced stages run
# under the same schedule code as the eager ones, so a schedule right in one mode and a mode right under 1F1B
# leave little between them.
@pytest.mark.slow
@pytest.mark.parametrize("schedule,mode", [
    ("1F1B", "eager"), ("InterleavedZeroBubble", "eager"),
    ("1F1B", "aot_fx_trace"), ("GPipe", "aot_fx_trace"), ("Interleaved1F1B", "aot_fx_trace"),
])
def test_pp2_equals_pp1_bitwise(schedule: str, mode: str):
    extra = CKPT if (schedule, mode) == ("1F1B", "aot_fx_trace") else ()
    _same(cached_train(_pp(schedule, mode, *extra), nproc=2), cached_train(REFERENCE))


@pytest.mark.slow
def test_traced_stages_compile_before_the_first_schedule():
    """Each rank compiles both of its Interleaved1F1B stages before its schedule runs (not at each stage's first
    microbatch, which waited for the previous rank's stage to compile and send), for inputs the schedule then feeds
    them: no stage traces twice."""
    records = cached_train(_pp("Interleaved1F1B", "aot_fx_trace"), nproc=2)
    assert (records[0]["pp_stages_compiled_first"], records[0]["retraces"]) == (2, 0)


DP2 = ("--model.n_layers", "4", "--training.batch_size", "8", "--training.seq_len", "64", "--training.steps", "3",
       "--parallelism.dp_shard", "2")
DP2_REFERENCE = (*DP2, "--compile.mode", "eager", "--training.gradient_accumulation_steps", "2")


def _stage_collectives(run: Path) -> int:
    """Data-parallel collectives in rank 0's stage graphs (forward and backward)."""
    graphs = [run / "graphs" / "stage_0" / name for name in ("02_forward.py", "03_backward.py")]
    return sum(g.read_text().count(op) for g in graphs for op in ("all_gather_into_tensor.default(", "reduce_scatter_tensor.default("))


@pytest.mark.slow
def test_pp2_by_dp_shard2_equals_dp_shard2_bitwise():
    """4 ranks: two pipeline stages, each sharded over two data-parallel ranks; `pp_gather microbatch`: FSDP gathers
    in each microbatch's stage graphs and reduce-scatters in its backward graph, as gradient accumulation does."""
    run = cached_run((*DP2, "--parallelism.pp", "2", "--parallelism.pp_gather", "microbatch", "--compile.mode", "aot_fx_trace",
                      "--compile.dump_graphs"), nproc=4)
    assert _stage_collectives(run) > 0
    _same(read_metrics(run), cached_train(DP2_REFERENCE, nproc=2))


@pytest.mark.slow
def test_stage_graphs_take_the_aot_overlap_passes():
    """`--compile.passes auto_bucketing` runs on each stage's joint, forward and backward graphs as in aot: the
    microbatch's FSDP gathers and reduce-scatters are bucketed, and training stays bitwise equal to dp_shard 2."""
    run = cached_run((*DP2, "--parallelism.pp", "2", "--parallelism.pp_gather", "microbatch", "--compile.mode", "aot_fx_trace",
                      "--compile.passes", "auto_bucketing", "--compile.dump_graphs"), nproc=4)
    stage = run / "graphs" / "stage_0"
    gathers = [(stage / name).read_text().count("all_gather_into_tensor.default(") for name in ("00_joint.py", "02_joint_auto_bucketing.py")]
    assert gathers[0] > gathers[1] > 0, gathers
    _same(read_metrics(run), cached_train(DP2_REFERENCE, nproc=2))


STEP_GATHER_BOUND = 1e-6
"""Relative difference of losses and grad norms, gathering once per step against pp 1: the microbatches' gradients
are added up before the reduce-scatter averages them over the ranks, not after; fp32 both ways (measured: 6e-8 on
the loss, 8e-8 on the grad norm over 3 steps; the same for DeepSeek V3 with ep 2)."""


def _within_step_gather_bound(records: list[dict]) -> None:
    reference = cached_train(DP2_REFERENCE, nproc=2)
    assert len(records) == len(reference) == 3
    pairs = list(zip(losses(records) + grad_norms(records), losses(reference) + grad_norms(reference)))
    assert all(abs(a - b) <= STEP_GATHER_BOUND * abs(b) for a, b in pairs), pairs


@pytest.mark.slow
def test_pp2_by_dp_shard2_gathers_once_per_step():
    """The default `pp_gather step`: the stage graphs hold no data-parallel collective (the parameters are gathered
    before the schedule and their gradients reduced after it), and training follows pp 1 within STEP_GATHER_BOUND."""
    run = cached_run((*DP2, "--parallelism.pp", "2", "--compile.mode", "aot_fx_trace", "--compile.dump_graphs"), nproc=4)
    assert _stage_collectives(run) == 0
    # one stage's graphs for one microbatch are no step to predict
    assert not (run / "prediction.json").exists()
    _within_step_gather_bound(read_metrics(run))


@pytest.mark.slow
def test_zero_bubble_traced_stages_split_backward_into_input_and_weight_graphs():
    """InterleavedZeroBubble, traced, pp 2 x dp_shard 2: each stage's backward graph is split (capture/backward_split.py)
    into an input-gradient graph run at the schedule's I slot and a weight-gradient graph run at its W slot. A later
    stage's input part holds the activation-gradient matmuls and its weight part the weight-gradient ones; the first
    stage's input has no gradient, so all of its backward waits for W. Training follows pp 1 as the unsplit graphs do."""
    run = cached_run((*DP2, "--parallelism.pp", "2", "--parallelism.pp_schedule", "InterleavedZeroBubble", "--parallelism.pp_microbatches", "2",
                      "--parallelism.pp_layers_per_stage", "1,1,1,1", "--compile.mode", "aot_fx_trace", "--compile.dump_graphs"), nproc=4)
    mms = {(stage, part): (run / "graphs" / f"stage_{stage}" / f"0{3 + part}_backward.py").read_text().count("aten.mm.default(")
           for stage in (0, 2) for part in (0, 1)}
    assert mms[(0, 0)] == 0 and mms[(0, 1)] > 0, mms
    assert mms[(2, 0)] > 0 and mms[(2, 1)] > 0, mms
    _within_step_gather_bound(read_metrics(run))


@pytest.mark.slow
def test_pp2_by_tp2_equals_tp2_bitwise():
    """The stages exchange the tp ranks' sequence shards (sequence parallelism between blocks)."""
    common = (*BASE, "--parallelism.tp", "2")
    reference = cached_train((*common, "--compile.mode", "eager", "--training.gradient_accumulation_steps", "4"), nproc=2)
    _same(cached_train((*common, "--parallelism.pp", "2", "--parallelism.pp_microbatches", "4", "--compile.mode", "aot_fx_trace"), nproc=4),
          reference)


@pytest.mark.slow
def test_moe_pp2_by_ep2_equals_ep2_bitwise():
    """DeepSeek V3 with expert parallelism; the first stage holds only the dense first block (explicit split
    1,3), so its rank has no expert gradient for the expert part of the norm."""
    common = ("--config", "configs/deepseek_v3_debug.toml", "--model.n_layers", "4", "--training.batch_size", "8",
              "--training.seq_len", "64", "--training.steps", "3", "--parallelism.dp_shard", "2", "--parallelism.ep", "2")
    reference = cached_train((*common, "--compile.mode", "eager", "--training.gradient_accumulation_steps", "2"), nproc=2)
    pp = ("--parallelism.pp", "2", "--parallelism.pp_layers_per_stage", "1,3", "--parallelism.pp_gather", "microbatch",
          "--compile.mode", "aot_fx_trace")
    _same(cached_train((*common, *pp), nproc=4), reference)


@pytest.mark.slow
def test_traced_stages_load_from_the_compile_cache_on_restart(tmp_path: Path):
    """Full-Inductor stage graphs go through the compile cache like the whole step's: the first start compiles and
    stores rank 0's forward and backward graphs, the second loads both and trains bit for bit the same. (The stage
    graphs are compiled inside AOTAutograd's tracing context, and hold an opaque input whose repr changes at every
    start: neither may leak into the entry's inputs or key.)"""
    args = ["--model.n_layers", "4", "--training.batch_size", "4", "--training.seq_len", "64", "--training.steps", "2",
            "--parallelism.pp", "2", "--parallelism.pp_microbatches", "2", "--compile.mode", "aot_fx_trace",
            "--compile.inductor_compilation", "full", "--compile.cache_dir", str(tmp_path / "cache")]
    cold = run_train(args, tmp_path / "cold", nproc=2)
    warm = run_train(args, tmp_path / "warm", nproc=2)
    assert (cold[0]["compile_cache"], cold[0]["compile_cache_entries_written"]) == ("miss", 2)
    assert (warm[0]["compile_cache"], warm[0]["compile_cache_entries_loaded"], warm[0]["compile_cache_entries_written"]) == ("hit", 2, 0)
    _same(warm, cold)


@pytest.mark.slow
@pytest.mark.parametrize("rank,held,absent", [(0, "tok_embeddings.weight", "output.weight"), (3, "output.weight", "tok_embeddings.weight")])
def test_fake_comm_simulates_one_pipeline_rank(rank: int, held: str, absent: str, tmp_path: Path):
    """`--comm.mode fake` runs rank 0 (first stage) or rank 3 (last stage) of a pp 2 x dp_shard 2 job in one process,
    traced: the process holds its stage's parameters only, and the neighbours' activations and gradients, which
    never arrive, are random values, so the steps stay finite."""
    args = ["--model.n_layers", "4", "--training.batch_size", "8", "--training.seq_len", "64", "--training.steps", "2",
            "--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--comm.mode", "fake", "--comm.fake_world_size", "4",
            "--comm.fake_rank", str(rank)]
    records = run_train(args, tmp_path)
    assert len(records) == 2 and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert records[0]["pp_stage_layers"] == "2,2" and all(r["grad_norm"] > 0 for r in records)
    placed = json.loads((tmp_path / "placements.json").read_text())
    assert held in placed and absent not in placed


def _resume(saved_by: Path, tmp_path: Path, args: tuple[str, ...], nproc: int) -> list[dict]:
    folder = tmp_path / "resumed"
    shutil.copytree(saved_by, folder)
    (folder / "metrics.jsonl").unlink()
    return run_train([*args, *CKPT, "--checkpoint.load_step", "2"], folder, nproc=nproc)


@pytest.mark.slow
def test_resume_pp2_checkpoint_on_pp1(tmp_path: Path):
    saved = cached_run(_pp("1F1B", "aot_fx_trace", *CKPT), nproc=2)
    resumed = _resume(saved, tmp_path, (*BASE, "--compile.mode", "eager", "--training.gradient_accumulation_steps", "4"), 1)
    _same(resumed, read_metrics(cached_run(REFERENCE))[2:])


@pytest.mark.slow
def test_resume_pp1_checkpoint_on_pp2(tmp_path: Path):
    resumed = _resume(cached_run(REFERENCE), tmp_path, _pp("1F1B", "aot_fx_trace"), 2)
    _same(resumed, read_metrics(cached_run(REFERENCE))[2:])


@pytest.mark.parametrize("flags,world_size,needle", [
    (["--model.n_layers", "5"], 2, "5 layers do not split evenly into 2 stages"),
    (["--parallelism.pp_microbatches", "1"], 2, "needs at least 2 microbatches"),
    (["--training.batch_size", "6", "--parallelism.pp_microbatches", "4"], 2, "does not split into 4 pipeline microbatches"),
    (["--compile.autoparallel", "--compile.autoparallel_impl", "meta"], 2, "does not combine with --compile.autoparallel_impl meta"),
    (["--validation.enable", "--validation.split", "0.1"], 2, "does not combine with --validation.enable"),
    (["--parallelism.pp_schedule", "InterleavedZeroBubble", "--model.n_layers", "4"], 2,
     "InterleavedZeroBubble with --compile.mode aot_fx_trace here"),
    (["--parallelism.pp_schedule", "InterleavedZeroBubble", "--model.n_layers", "4", "--parallelism.dp_shard", "2", "--compile.mode", "eager"],
     4, "InterleavedZeroBubble in eager with --parallelism.pp_gather step"),
    (["--compile.passes", "transformer_block_bucketing"], 2, "--compile.passes transformer_block_bucketing (whole-step graphs only"),
], ids=["layers", "microbatches", "batch", "meta_placement", "validation", "zero_bubble_traced_dtensors", "zero_bubble_eager_gathered",
        "whole_step_pass"])
def test_refusals_are_one_line_exit_2(flags, world_size, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")

    def tripwire(cfg):
        raise AssertionError("validation let this configuration through to training")

    monkeypatch.setattr("graph_trainer.trainer.run", tripwire)
    code = cli.main(["train", "--job.dump_folder", str(tmp_path), "--parallelism.pp", "2", *flags])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("[rank 0] graph-trainer: error: ") and needle in lines[0], lines[0]


@pytest.mark.slow
def test_precompile_warms_every_pipeline_rank(tmp_path: Path):
    """`graph-trainer precompile` with pp 2 compiles each pipeline rank's stages on the fake process group (fake
    rank 0 and fake rank 1); the 2-rank gloo job then loads every stage graph and compiles none."""
    flags = ("--model.n_layers", "2", "--training.batch_size", "2", "--training.seq_len", "32", "--training.steps", "2",
             "--parallelism.pp", "2", "--parallelism.dp_shard", "1", "--compile.inductor_compilation", "full",
             "--compile.cache_dir", str(tmp_path / "cache"))
    proc = launch(["precompile", "--job.dump_folder", str(tmp_path / "pre"), *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "precompile: rank 0: miss; rank 1: miss" in proc.stdout
    stored = {p.name for p in (tmp_path / "cache").iterdir()}
    assert len(stored) == 4  # each rank's stage: a forward and a backward graph
    job = launch(["train", "--job.dump_folder", str(tmp_path / "job"), *flags], nproc=2)
    assert job.returncode == 0, job.stderr[-3000:]
    first = read_metrics(tmp_path / "job")[0]
    assert (first["compile_cache"], first["compile_cache_entries_loaded"], first["compile_cache_entries_written"]) == ("hit", 2, 0)
    # rank 1 reports no metrics: that it loaded too shows in the cache, which a rank that compiled would have added to
    assert {p.name for p in (tmp_path / "cache").iterdir()} == stored


def _export(step_folder: Path, out: Path) -> dict:
    from safetensors.torch import load_file

    assert cli.main(["export", "--checkpoint", str(step_folder), "--out", str(out)]) == 0
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_hf_export_of_a_pp_checkpoint_and_hf_start_on_pp2(tmp_path: Path):
    """`graph-trainer export` of a pp 2 step equals that of the pp 1 step (every stage's tensors, bitwise);
    a pp 2 run starts from a Hugging Face folder as pp 1 does."""
    pp_weights = _export(cached_run(_pp("1F1B", "aot_fx_trace", *CKPT), nproc=2) / "checkpoint" / "step-3", tmp_path / "hf_pp")
    reference = _export(cached_run(REFERENCE) / "checkpoint" / "step-3", tmp_path / "hf")
    assert pp_weights.keys() == reference.keys() and all(pp_weights[k].equal(reference[k]) for k in reference)
    start = ("--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf", "--training.steps", "1")
    pp = run_train([*_pp("1F1B", "aot_fx_trace"), *start], tmp_path / "pp_run", nproc=2)
    _same(pp, run_train([*BASE, "--compile.mode", "eager", "--training.gradient_accumulation_steps", "4", *start], tmp_path / "pp1_run"))
