"""Pipeline stages placed by the built-in solver (`--parallelism.pp` with `--compile.autoparallel`): each
stage's graph is solved on the mesh of its pipeline rank (autoparallel.entry.solve_stages), with its input
and output in the token batch's layout, so a stage hands its neighbour what the schedule sends.

Parity: the stages run the same ops on the same layouts as the auto-placed pp 1 run with the schedule's
microbatches as gradient-accumulation steps (the schedule feeds them in that order), so losses and gradient
norms are equal bit for bit. The DeepSeek case is eager: the MoE path at a stage boundary, one plan per stage.
Its stages' plans place every parameter as pp 1's does, but the solver may pick other activation layouts of the
same price for a stage than for the whole model (8 of 230 nodes on one CPU: a shard where pp 1 keeps a partial
sum), so some sums run in another order: losses and gradient norms within a relative 1e-6 (measured 7e-8)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from helpers import cached_run, cached_train, grad_norms, launch, losses, run_train

from graph_trainer import cli
from graph_trainer.metrics import read_metrics

SHAPE = ("--model.n_layers", "4", "--training.batch_size", "8", "--training.seq_len", "64")
STEPS = ("--training.steps", "3", "--compile.autoparallel")


def _same(records: list[dict], reference: list[dict]) -> None:
    assert len(records) == len(reference) == 3
    assert losses(records) == losses(reference)
    assert grad_norms(records) == grad_norms(reference)


def _close(records: list[dict], reference: list[dict], rel: float = 1e-6) -> None:
    assert len(records) == len(reference) == 3
    for got, want in ((losses(records), losses(reference)), (grad_norms(records), grad_norms(reference))):
        assert all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want)), (got, want)


def _collectives(graph: Path) -> int:
    text = graph.read_text()
    return sum(text.count(op) for op in ("all_gather_into_tensor.default(", "reduce_scatter_tensor.default(", "all_reduce.default("))


@pytest.mark.slow
def test_auto_placed_stages_by_tp2_equal_pp1_bitwise():
    """pp 2 x tp 2, traced stages: the plan's tensor-parallel collectives are in each stage's forward and
    backward graphs, and training equals the auto-placed tp 2 run with two accumulation steps."""
    common = (*SHAPE, *STEPS, "--parallelism.dp_shard", "1", "--parallelism.tp", "2")
    run = cached_run((*common, "--parallelism.pp", "2", "--compile.mode", "aot_fx_trace", "--compile.dump_graphs"), nproc=4)
    stage = run / "graphs" / "stage_0"
    assert _collectives(stage / "02_forward.py") > 0 and _collectives(stage / "03_backward.py") > 0
    placements = json.loads((run / "placements.json").read_text())
    # rank 0 holds the first stage only, some of it split over tp
    assert "tok_embeddings.weight" in placements and "output.weight" not in placements
    assert any(p["placements"][2].startswith("Shard") for p in placements.values()), placements
    _same(read_metrics(run), cached_train((*common, "--compile.mode", "eager", "--training.gradient_accumulation_steps", "2"), nproc=2))


@pytest.mark.slow
def test_auto_placed_moe_stages_by_ep2_train_like_pp1():
    """DeepSeek V3, the first stage only its dense first block: each stage's plan pins expert parallelism over dp_shard."""
    common = ("--config", "configs/deepseek_v3_debug.toml", *SHAPE, *STEPS, "--parallelism.dp_shard", "2", "--parallelism.ep", "2",
              "--compile.mode", "eager")
    reference = cached_run((*common, "--training.gradient_accumulation_steps", "2"), nproc=2)
    staged = cached_run((*common, "--parallelism.pp", "2", "--parallelism.pp_layers_per_stage", "1,3"), nproc=4)
    _close(read_metrics(staged), read_metrics(reference))
    stage_params = [p for stage in json.loads((staged / "plan.json").read_text())["stages"] for p in stage["params"].items()]
    whole = json.loads((reference / "plan.json").read_text())["params"]
    assert len(stage_params) == len(whole) and all(whole[name] == placement for name, placement in stage_params)


INTERLEAVED = ("--parallelism.pp", "2", "--parallelism.pp_schedule", "Interleaved1F1B")


@pytest.fixture(scope="module")
def interleaved_plan(tmp_path_factory) -> Path:
    """`graph-trainer plan` of pp 2 x dp_shard 2 under Interleaved1F1B: four stages of one layer."""
    folder = tmp_path_factory.mktemp("plan")
    proc = launch(["plan", *SHAPE, "--parallelism.dp_shard", "2", *INTERLEAVED, "--job.dump_folder", str(folder)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line for line in proc.stdout.splitlines() if line.startswith("== stage")] == [
        "== stage 0 (pipeline rank 0, layers 0-0) ==", "== stage 1 (pipeline rank 1, layers 1-1) ==",
        "== stage 2 (pipeline rank 0, layers 2-2) ==", "== stage 3 (pipeline rank 1, layers 3-3) =="]
    return folder / "plan.json"


def _storage(spec: list[str]) -> str:
    """A plan's storage layout on its one solver dim (dp_shard) as placements.json writes it."""
    return {"R": "Replicate()"}.get(spec[0], f"Shard(dim={spec[0][1:]})")


@pytest.mark.slow
def test_a_saved_pipeline_plan_places_each_rank_s_stages(interleaved_plan: Path, tmp_path: Path):
    """The plan file holds every stage's plan; rank 0 places its two stages (0 and 2) as the file says. (That the
    placed stages train as pp 1 does is the other tests' part: a plan priced for an H100 may pick other layouts
    than this CPU job's own solve, with other reduction orders.)"""
    plan = json.loads(interleaved_plan.read_text())
    assert plan["pipeline"] == {"pp": 2, "schedule": "Interleaved1F1B", "microbatches": 4, "layers": [[0], [1], [2], [3]]}
    assert [s["batch"]["global_microbatch"] for s in plan["stages"]] == [[2, 64]] * 4
    dp2 = (*SHAPE, *STEPS, "--parallelism.dp_shard", "2", *INTERLEAVED)
    records = run_train([*dp2, "--compile.autoparallel_plan", str(interleaved_plan), "--compile.mode", "aot_fx_trace"], tmp_path, nproc=4)
    placed = json.loads((tmp_path / "placements.json").read_text())
    planned = {**plan["stages"][0]["params"], **plan["stages"][2]["params"]}
    assert sorted(placed) == sorted(planned)
    assert {n: p["placements"][1] for n, p in placed.items()} == {n: _storage(p["storage"]) for n, p in planned.items()}
    assert len(records) == 3 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)


@pytest.mark.parametrize("flags,needle", [
    (["--parallelism.pp_schedule", "1F1B"], "was made for --parallelism.pp 2 Interleaved1F1B, 4 microbatches, stage layer counts "
                                            "1,1,1,1, not --parallelism.pp 2 1F1B, 2 microbatches, stage layer counts 2,2"),
    (["--parallelism.pp_schedule", "Interleaved1F1B", "--parallelism.pp_layers_per_stage", "2,0,1,1"],
     "not --parallelism.pp 2 Interleaved1F1B, 4 microbatches, stage layer counts 2,0,1,1"),
    (["--parallelism.pp", "1"], "not no pipeline (--parallelism.pp 1)"),
], ids=["schedule", "layers", "no_pipeline"])
def test_a_plan_for_other_stages_is_refused(interleaved_plan: Path, flags, needle, tmp_path, monkeypatch, capsys):
    pp = 1 if flags == ["--parallelism.pp", "1"] else 2
    monkeypatch.setenv("WORLD_SIZE", str(2 * pp))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")

    def tripwire(cfg):
        raise AssertionError("validation let this configuration through to training")

    monkeypatch.setattr("graph_trainer.trainer.run", tripwire)
    code = cli.main(["train", "--job.dump_folder", str(tmp_path), *SHAPE, "--parallelism.dp_shard", "2", "--parallelism.pp", "2",
                     "--compile.autoparallel", "--compile.autoparallel_plan", str(interleaved_plan), *flags])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("[rank 0] graph-trainer: error: compile.autoparallel_plan ") and needle in lines[0], lines[0]
