"""--metrics.enable_tensorboard / --metrics.enable_wandb: every logged step's figures, as metrics.jsonl holds them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import cached_run, child_env, launch

from graph_trainer.metrics import read_metrics
from graph_trainer.metrics_writers import wandb_missing

MOE = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--model.n_layers", "2",
       "--training.batch_size", "4", "--training.seq_len", "64", "--training.steps", "3", "--compile.mode", "eager"]


TENSORBOARD = (*MOE, "--metrics.enable_tensorboard")


def test_logged_lr_is_the_one_the_step_used():
    """The default schedule (peak 8e-4, 2 warm-up steps, linear decay to 0 over the rest) gives steps 1..3
    the factors 1/2, 2/2, 1 (decay starts at 1); the factor after the last step, 0, is used by no step."""
    records = read_metrics(cached_run(TENSORBOARD))
    assert [r["lr"] for r in records] == [4e-4, 8e-4, 8e-4]


def test_tensorboard_holds_every_step_of_metrics_jsonl():
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = cached_run(TENSORBOARD)
    records = read_metrics(folder)
    assert [r["step"] for r in records] == [1, 2, 3]
    events = EventAccumulator(str(folder / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    # mfu is only known on a GPU; a MoE model reports dropped tokens.
    assert tags == {"loss", "grad_norm", "lr", "tokens_per_second", "peak_memory_gib", "step_time_s", "dropped_tokens"}
    for tag in tags:
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [1, 2, 3], tag
        # TensorBoard stores scalars as float32.
        assert [s.value for s in scalars] == [float(np.float32(r[tag])) for r in records], tag


def test_wandb_without_the_package_is_refused_before_training(tmp_path):
    # wandb is a test dependency: the child sees it missing through a None entry in sys.modules, which
    # both `import wandb` and importlib.util.find_spec report as an absent package.
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text('import sys\nsys.modules["wandb"] = None\n')
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocker), env.get("PYTHONPATH")]))
    dump = tmp_path / "dump"
    proc = launch(["train", "--job.dump_folder", str(dump), *MOE, "--metrics.enable_wandb"], env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == ["graph-trainer: error: --metrics.enable_wandb needs the wandb package, which is not installed: "
                     "pip install wandb, or drop the flag"]
    assert not (dump / "metrics.jsonl").exists()


def offline_run_records(folder: Path) -> list[dict]:
    """The records of the one offline run under `folder`, read from its .wandb transaction log by the
    reader wandb ships (`wandb leet inspect --json`, one record a line): wandb 0.31 writes no
    wandb-summary.json offline and has no Python reader of the log any more."""
    logs = list(folder.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 1, logs
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(logs[0])],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.skipif(wandb_missing(), reason="wandb is not installed")
def test_wandb_offline_run_holds_every_step_of_metrics_jsonl(tmp_path):
    proc = launch(["train", "--job.dump_folder", str(tmp_path), *MOE, "--metrics.enable_wandb"],
                  env=child_env(WANDB_MODE="offline", WANDB_SILENT="true"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    logged = offline_run_records(tmp_path / "wandb")
    history = [r["history"] for r in logged if r["type"] == "history"]
    assert [h["step"]["num"] for h in history] == [1, 2, 3]
    for h, record in zip(history, records):
        # wandb adds its own keys, all with a leading underscore (_step, _runtime, _timestamp).
        figures = {k: v for k, v in h["item"].items() if not k.startswith("_")}
        assert set(figures) == {"loss", "grad_norm", "lr", "tokens_per_second", "peak_memory_gib", "step_time_s",
                                "dropped_tokens"}, record["step"]
        # Float64 all the way: Python's and Go's JSON both print the shortest repr that reads back exactly.
        assert figures == {k: record[k] for k in figures}, record["step"]
    # wandb.finish() ran: the log ends with the run's exit record.
    assert logged[-1]["type"] == "exit" and logged[-1]["exit"]["exit_code"] == 0, logged[-1]
