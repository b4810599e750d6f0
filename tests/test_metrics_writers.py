"""--metrics.enable_tensorboard / --metrics.enable_wandb: every logged step's figures, as metrics.jsonl holds them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import launch, run_train

from graph_trainer.metrics_writers import wandb_missing

MOE = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--model.n_layers", "2",
       "--training.batch_size", "4", "--training.seq_len", "64", "--training.steps", "3", "--compile.mode", "eager"]


def test_tensorboard_holds_every_step_of_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = run_train([*MOE, "--metrics.enable_tensorboard"], tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    # mfu is only known on a GPU; a MoE model reports dropped tokens.
    assert tags == {"loss", "grad_norm", "lr", "tokens_per_second", "peak_memory_gib", "step_time_s", "dropped_tokens"}
    for tag in tags:
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [1, 2, 3], tag
        # TensorBoard stores scalars as float32.
        assert [s.value for s in scalars] == [float(np.float32(r[tag])) for r in records], tag


@pytest.mark.skipif(not wandb_missing(), reason="wandb is installed")
def test_wandb_without_the_package_is_refused_before_training(tmp_path):
    proc = launch(["train", "--job.dump_folder", str(tmp_path), *MOE, "--metrics.enable_wandb"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["graph-trainer: error: --metrics.enable_wandb needs the wandb package, which is not installed: "
                     "pip install wandb, or drop the flag"]
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.skipif(wandb_missing(), reason="wandb is not installed")
def test_wandb_offline_run_records_the_last_step(tmp_path):
    from helpers import child_env

    proc = launch(["train", "--job.dump_folder", str(tmp_path), *MOE, "--metrics.enable_wandb"],
                  env=child_env(WANDB_MODE="offline", WANDB_SILENT="true"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    summaries = list((tmp_path / "wandb").glob("wandb/offline-run-*/files/wandb-summary.json"))
    assert len(summaries) == 1
    summary = json.loads(summaries[0].read_text())
    assert summary["loss"] == last["loss"]
    assert summary["_step"] == 3
