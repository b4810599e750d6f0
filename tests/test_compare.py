"""`graph-trainer compare`: one 2-rank compare of four runs (the SimpleFSDP plan, the solver's plan, a
run the trainer refuses, the SimpleFSDP plan with bucketing) serves the end-to-end tests; bad input
is checked in process."""

from __future__ import annotations

import json
import statistics

import pytest

from graph_trainer.cli import main
from graph_trainer.compare import parse_run_spec
from graph_trainer.metrics import read_metrics
from tests.helpers import launch

STEPS = 5
WARMUP = 3
RUNS = ["manual", "auto", "manual:none:no_such_pass", "manual:none:auto_bucketing"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    proc = launch(["compare", "--config", "configs/llama3_debug.toml", "--nproc", "2", "--steps", str(STEPS), "--warmup", str(WARMUP),
                   "--out", str(out), "--runs", ",".join(RUNS), "--training.batch_size", "4", "--training.seq_len", "64",
                   "--model.n_layers", "2"])
    assert (out / "report.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    return out, proc, report, {r["name"]: r for r in report["runs"]}


def test_compare_writes_the_report_and_streams_progress(compared):
    out, proc, report, _ = compared
    assert proc.returncode == 1, "one run failed, so compare exits 1"
    for name in ("report.md", "loss.png", "tokens_per_second.png", "peak_memory.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["name"] for r in report["runs"]] == RUNS
    assert "[compare] run 2/4 auto: " in proc.stdout and "[compare] run 4/4 manual:none:auto_bucketing: ok" in proc.stdout
    assert "[manual] step:    1  loss:" in proc.stdout and f"[auto] step:    {STEPS}  loss:" in proc.stdout

    ok = [r for r in report["runs"] if r["status"] == "ok"]
    assert [r["steps"] for r in ok] == [STEPS] * 3 and [len(r["metrics"]) for r in ok] == [STEPS] * 3
    for r in ok:
        steady = [m["tokens_per_second"] for m in r["metrics"] if m["step"] > WARMUP]
        assert r["tokens_per_second"] == statistics.median(steady) and r["mfu"] is None
        assert r["peak_memory_gib"] > 0 and r["final_loss"] == r["metrics"][-1]["loss"]
        assert {"time_to_first_step_s", "placement_s", "trace_s", "compile_s"} <= set(r["first_step_times_s"])
    md = (out / "report.md").read_text()
    for section in ("## Runs", "## Loss per step", "## Communication per step", "## Placements that differ from manual", "![loss](loss.png)"):
        assert section in md


def test_compare_diffs_losses_communication_and_placements(compared):
    out, _, report, runs = compared
    manual, auto, bucketed = runs["manual"], runs["auto"], runs["manual:none:auto_bucketing"]
    assert report["reference"] == "manual"

    # The diffs, recomputed from each run's own metrics.jsonl rather than from the report.
    def losses(folder: str) -> list[float]:
        return [r["loss"] for r in read_metrics(out / "runs" / folder)]

    reference = losses("01-manual")
    assert len(reference) == STEPS
    for run, folder in ((auto, "02-auto"), (bucketed, "04-manual_none_auto_bucketing")):
        theirs = losses(folder)
        assert [d["step"] for d in run["loss_diff"]] == list(range(1, STEPS + 1))
        assert [d["abs_diff"] for d in run["loss_diff"]] == [abs(a - b) for a, b in zip(theirs, reference)]
        assert run["max_loss_diff"] == max(abs(a - b) for a, b in zip(theirs, reference))
    # Bucketing only merges collectives: bitwise the same losses. The solver's plan reduces in another
    # order (the norm weight is replicated, not sharded), so its losses may differ in the last bits.
    assert losses("04-manual_none_auto_bucketing") == reference
    assert auto["max_loss_diff"] < 1e-4

    # Both schedules merge the same collectives (the same bytes; read from the last stage). The default one (manual:
    # an empty pass field) has one bucket per block and kind: gathers of [tok_embeddings], 2 blocks, [norm, output]
    # and the 2 blocks again for backward; reduce-scatters of 2 blocks and the two runs beside them.
    # auto_bucketing's buckets are sized by the link, fewer than the 21 parameters either way.
    kinds = ("all_gather", "reduce_scatter")
    assert {k: manual["communication_per_step"][k]["count"] for k in kinds} == {"all_gather": 6, "reduce_scatter": 4}
    for kind in kinds:
        assert 0 < bucketed["communication_per_step"][kind]["count"] < 21
        assert bucketed["communication_per_step"][kind]["bytes"] == manual["communication_per_step"][kind]["bytes"]

    assert manual["placement_diff"] == [] and bucketed["placement_diff"] == []
    placements = json.loads((out / "runs" / "01-manual" / "placements.json").read_text())
    assert placements["norm.weight"]["placements"][placements["norm.weight"]["mesh_dim_names"].index("dp_shard")] == "Shard(dim=0)"
    # The solver replicates the small final norm over dp_shard where SimpleFSDP shards it.
    rows = {row["parameter"]: row for row in auto["placement_diff"]}
    assert rows["norm.weight"] == {"parameter": "norm.weight", "reference": "dp_shard:Shard(dim=0)", "run": "dp_shard:Replicate()"}
    md = (out / "report.md").read_text()
    assert "| norm.weight | dp_shard:Shard(dim=0) | dp_shard:Replicate() |" in md
    assert "**manual:none:auto_bucketing**: same placements as manual for every parameter." in md


def test_a_failed_run_is_reported_and_the_others_still_run(compared):
    out, _, _, runs = compared
    failed = runs["manual:none:no_such_pass"]
    assert failed["status"] == "failed" and failed["returncode"] != 0 and failed["metrics"] == []
    assert failed["error"] == "graph-trainer: error: unknown pass 'no_such_pass'; see --compile.list_passes for the valid names"
    assert runs["manual:none:auto_bucketing"]["status"] == "ok", "the run after the failed one still runs"
    md = (out / "report.md").read_text()
    assert "| manual:none:no_such_pass | FAILED (exit 1) |" in md and "unknown pass 'no_such_pass'" in md


def test_run_spec_grammar():
    spec = parse_run_spec("auto:full:auto_bucketing+reshard_after_forward")
    assert (spec.placement, spec.backend, spec.passes, spec.mode) == ("auto", "full", ("auto_bucketing", "reshard_after_forward"), "aot_fx_trace")
    spec = parse_run_spec("manual:::eager")
    assert (spec.backend, spec.passes, spec.mode) == ("none", (), "eager")
    assert "--compile.autoparallel" not in spec.train_flags()


def test_bad_input_is_one_line_and_exit_2_before_any_run(tmp_path, capsys):
    out = tmp_path / "out"
    cases = [
        (["--runs", "manual,sideways"], "run spec 'sideways': placement 'sideways' is not one of manual, auto"),
        (["--nproc", "0"], "--nproc must be >= 1, got 0"),
        (["--config", str(tmp_path / "missing.toml")], "missing.toml does not exist; pass an existing --config FILE.toml"),
        (["--compile.mode", "eager"], "--compile.mode is set by compare for each run; put the mode in --runs, e.g. manual:::eager"),
    ]
    for args, message in cases:
        assert main(["compare", "--out", str(out), *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("graph-trainer: error: ") and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists(), "nothing ran"
    assert main(["compare", "--help"]) == 0 and "PLACEMENT[:BACKEND[:PASSES[:MODE]]]" in capsys.readouterr().out


def test_exit_code_is_0_when_every_run_succeeds(tmp_path, monkeypatch, capsys):
    """The runs replaced by a stand-in that writes what a trainer's rank 0 writes."""
    import graph_trainer.compare as compare

    def fake_launch(run, command, log_path):
        folder = log_path.parent
        log_path.write_text("")
        records = [{"step": s, "loss": 1.0 / s, "tokens_per_second": 100.0 * s, "mfu": None, "peak_memory_gib": 0.5} for s in (1, 2, 3, 4)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return 0

    monkeypatch.setattr(compare, "launch", fake_launch)
    assert main(["compare", "--out", str(tmp_path), "--steps", "4", "--runs", "manual,manual:::eager"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["ok", "ok"] and report["runs"][1]["max_loss_diff"] == 0
    assert report["runs"][0]["tokens_per_second"] == 400.0 and report["runs"][1]["placement_diff"] is None
    assert "failed runs" not in capsys.readouterr().out
