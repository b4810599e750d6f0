"""Manual placement (SimpleFSDP, TP, HSDP) in eager mode: N ranks train like one (fp32, CPU, gloo)."""

import json

import pytest

from helpers import cached_train, losses

BASE = ("--training.steps", "10", "--training.seq_len", "128", "--model.n_layers", "2")
EAGER = ("--compile.mode", "eager")
"""After the mesh flags: test_fx_trace.py's eager references are these same runs (helpers.cached_run)."""
MESHES = {
    "dp_shard2": (2, ("--parallelism.dp_shard", "2")),
    "tp2": (2, ("--parallelism.dp_shard", "1", "--parallelism.tp", "2")),
    "hsdp2": (2, ("--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1")),
    "dp_shard2_tp2": (4, ("--parallelism.dp_shard", "2", "--parallelism.tp", "2")),
}


def single_rank() -> list[dict]:
    return cached_train(BASE + EAGER, 1)


def test_single_rank_loss_falls_and_logs_every_field():
    records = single_rank()
    assert [r["step"] for r in records] == list(range(1, 11))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_second", "mfu", "peak_memory_gib", "step_time_s"):
        assert key in records[0]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_ranks_match_single_process(mesh):
    nproc, flags = MESHES[mesh]
    reference = losses(single_rank())[:5]
    got = losses(cached_train(BASE + flags + EAGER, nproc))[:5]
    assert got == pytest.approx(reference, abs=1e-5), (mesh, got, reference)


def test_resolved_config_is_written(tmp_path):
    from helpers import run_train

    run_train(["--training.steps", "1", "--training.seq_len", "32", "--training.batch_size", "2"], tmp_path)
    text = (tmp_path / "config.toml").read_text()
    assert "[training]" in text and "steps = 1" in text and "seq_len = 32" in text
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
