"""Faults: a non-finite step, a stop signal, a rank that dies or stops answering, resumes on another
number of ranks.

Faults are injected through the trainer's test-only environment variables:
GRAPH_TRAINER_INJECT_NAN_AT_STEP=N (a NaN weight before step N) and
GRAPH_TRAINER_SIGNAL_AT_STEP=N:SIGNAME[:RANK] (the process sends itself a real signal before step N).
The scenarios of bench/faults.py (which the GPUs run with NCCL) run here on 2 gloo ranks; the tests
below it cover what the script does not: torchrun in between, a silent rank, a segfault.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from graph_trainer.compare import torchrun
from helpers import child_env, launch, read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import faults  # noqa: E402
from faults import Watched, error_lines, launch_ranks, steps_saved  # noqa: E402

SMALL = ["--training.batch_size", "2", "--training.seq_len", "64", "--model.n_layers", "2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "docs.txt"
    path.write_text("\n\n".join(f"chapter {i}: " + "and the rank said unto the other rank, gather " * (8 + i % 5) for i in range(300)))
    return path


def flags(data: Path, *extra: str) -> list[str]:
    return [*SMALL, "--training.dataset_path", str(data), *extra]


def train_args(folder: Path, data: Path, *extra: str) -> list[str]:
    return ["train", "--job.dump_folder", str(folder), *flags(data, *extra)]


EXPECTED_CHECKS = {"kill": 6, "sigterm": 7, "resume": 8, "nan": 5}
"""Checks per scenario (sigterm's include the uninterrupted run's and the stop's): a scenario that stopped
checking part of its outcome fails here, not only one whose checks failed."""


def test_fault_script_on_two_gloo_ranks(tmp_path, data):
    """kill -9 of a rank, SIGTERM, resume 2 -> 1 -> 2 ranks, NaN: the same script the GPUs run."""
    out = tmp_path / "faults"
    code = faults.main(["--nproc", "2", "--out", str(out), "--only", ",".join(EXPECTED_CHECKS), "--", *flags(data)])
    report = json.loads((out / "faults.json").read_text())
    failed = [(s["name"], c) for s in report["scenarios"] for c in s["checks"] if not c["ok"]]
    assert code == 0 and not failed, failed
    assert {s["name"]: len(s["checks"]) for s in report["scenarios"]} == EXPECTED_CHECKS
    md = (out / "faults.md").read_text()
    assert "GRAPH_TRAINER_SIGNAL_AT_STEP=2:SIGKILL:1 python -m graph_trainer train" in md
    assert "| resume | yes | 8/8 |" in md


def test_a_segfault_prints_the_python_stack_of_the_step_it_died_in(tmp_path, data):
    proc = launch(train_args(tmp_path / "run", data, "--training.steps", "3"),
                  env=child_env(GRAPH_TRAINER_SIGNAL_AT_STEP="2:SIGSEGV"))
    assert proc.returncode == -signal.SIGSEGV
    report = proc.stderr[proc.stderr.index("Fatal Python error: Segmentation fault"):]
    assert "Current thread" in report
    assert 'graph_trainer/trainer.py", line' in report and "in inject_test_faults" in report
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]


@pytest.mark.slow
def test_sigint_on_one_rank_stops_every_rank_after_the_same_step(tmp_path, data):
    folder = tmp_path / "run"
    args = train_args(folder, data, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "100")
    proc = launch(args, nproc=2, env=child_env(GRAPH_TRAINER_SIGNAL_AT_STEP="2:SIGINT:1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped after step 2 on a stop signal (sent to another rank)" in proc.stderr
    assert steps_saved(folder) == [2]
    assert [r["step"] for r in read_metrics(folder)] == [1, 2]


def stop_all(ranks: list[Watched]) -> None:
    for r in ranks:
        r.kill()


def test_killed_rank_under_torchrun_makes_the_others_exit_within_the_timeout(tmp_path, data):
    """torchrun in between (the script launches the ranks itself): it reports the failure, exit code 1."""
    timeout_s = 60
    args = train_args(tmp_path / "run", data, "--training.steps", "20", "--parallelism.dp_shard", "2",
                      "--comm.timeout_seconds", str(timeout_s))
    run = Watched([*torchrun(2), "-m", "graph_trainer", *args], child_env(GRAPH_TRAINER_SIGNAL_AT_STEP="2:SIGKILL:1"))
    try:
        code, after_step_1 = run.wait(timeout=300)
    finally:
        stop_all([run])
    assert code != 0
    assert after_step_1 < timeout_s, f"rank 0 took {after_step_1:.0f} s to give up on a dead peer"
    (line,) = [line for line in error_lines(run.stderr) if line.startswith("[rank 0]")]
    assert "a collective failed at step 2" in line and f"--comm.timeout_seconds={timeout_s}" in line


@pytest.mark.slow
def test_silent_rank_makes_the_others_exit_after_the_timeout(tmp_path, data):
    """A stopped (not dead) peer: only the step's deadline can tell (the step watchdog, before gloo's own
    timeout, which comes 30 s later: the same way out as on NCCL)."""
    timeout_s = 20
    args = train_args(tmp_path / "run", data, "--training.steps", "20", "--parallelism.dp_shard", "2",
                      "--comm.timeout_seconds", str(timeout_s))
    ranks = launch_ranks(args, 2, GRAPH_TRAINER_SIGNAL_AT_STEP="2:SIGSTOP:1")
    try:
        code, after_step_1 = ranks[0].wait(timeout=300)
    finally:
        stop_all(ranks)
    assert code == 4 and "Traceback" not in ranks[0].stderr
    assert timeout_s <= after_step_1 < timeout_s + 30, after_step_1
    (line,) = error_lines(ranks[0].stderr)
    assert "a collective failed at step 2 (not finished after" in line


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_before_the_workers_exit(tmp_path, data):
    """Preemption: the scheduler signals torchrun, which forwards SIGTERM to every worker and waits."""
    folder = tmp_path / "run"
    args = train_args(folder, data, "--training.steps", "50", "--parallelism.dp_shard", "2",
                      "--checkpoint.enable", "--checkpoint.interval", "100")
    cmd = [*torchrun(2), "-m", "graph_trainer", *args]
    run = Watched(cmd, child_env(), "step:    2 ")
    try:
        while run.marker_time is None and run.proc.poll() is None:
            time.sleep(0.1)
        assert run.proc.poll() is None, run.stderr[-3000:]
        os.kill(run.proc.pid, signal.SIGTERM)
        run.wait(timeout=120)
    finally:
        stop_all([run])
    (stopped,) = [line for line in run.lines if "stopped after step" in line]
    step = int(stopped.split("stopped after step ")[1].split()[0])
    assert steps_saved(folder) == [step]
    assert [r["step"] for r in read_metrics(folder)][-1] == step
