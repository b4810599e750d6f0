"""Pipeline parallelism (`--parallelism.pp`): the stage split, parity with pp 1, resume across pp degrees,
and the up-front refusals.

Parity is bitwise: a pp run's schedule microbatches are the microbatches of a pp 1 run with as many
gradient-accumulation steps (same data, same loss scaling, gradients added in the same order), and the
gradient norm reduces every stage's per-tensor norms as pp 1 reduces the whole model's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import cached_run, cached_train, grad_norms, losses, run_train

from graph_trainer import cli, models
from graph_trainer.config import parse_args
from graph_trainer.metrics import read_metrics
from graph_trainer.parallel.pipeline import build_layout, prune_to_rank, split_layers, stage_views

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
def test_pp2_by_dp_shard2_equals_dp_shard2_bitwise():
    """4 ranks: two pipeline stages, each sharded over two data-parallel ranks (FSDP gathers in the stage graphs)."""
    common = ("--model.n_layers", "4", "--training.batch_size", "8", "--training.seq_len", "64", "--training.steps", "3",
              "--parallelism.dp_shard", "2")
    reference = cached_train((*common, "--compile.mode", "eager", "--training.gradient_accumulation_steps", "2"), nproc=2)
    _same(cached_train((*common, "--parallelism.pp", "2", "--compile.mode", "aot_fx_trace"), nproc=4), reference)


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
    pp = ("--parallelism.pp", "2", "--parallelism.pp_layers_per_stage", "1,3", "--compile.mode", "aot_fx_trace")
    _same(cached_train((*common, *pp), nproc=4), reference)


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
    (["--compile.autoparallel"], 2, "does not combine with --compile.autoparallel"),
    (["--validation.enable", "--validation.split", "0.1"], 2, "does not combine with --validation.enable"),
    (["--parallelism.pp_schedule", "InterleavedZeroBubble", "--model.n_layers", "4"], 2,
     "InterleavedZeroBubble with --compile.mode aot_fx_trace"),
], ids=["layers", "microbatches", "batch", "autoparallel", "validation", "zero_bubble_traced"])
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


@pytest.mark.parametrize("command", ["plan", "precompile"])
def test_plan_and_precompile_refuse_pp(command, tmp_path, capsys):
    code = cli.main([command, "--job.dump_folder", str(tmp_path), "--parallelism.pp", "2", "--parallelism.dp_shard", "2"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "drop --parallelism.pp 2" in lines[0], lines


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
