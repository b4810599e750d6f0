"""Faults: a non-finite step, a stop signal, a rank that dies or stops answering.

Faults are injected through the trainer's test-only environment variables:
GRAPH_TRAINER_INJECT_NAN_AT_STEP=N (a NaN weight before step N) and
GRAPH_TRAINER_SIGNAL_AT_STEP=N:SIGNAME[:RANK] (the process sends itself a real signal before step N).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from graph_trainer.compare import torchrun
from helpers import REPO, child_env, free_port, launch, losses, read_metrics, run_train

from graph_trainer.checkpoint import complete_checkpoints

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


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "graph-trainer: error:" in line]


def steps_saved(folder: Path) -> list[int]:
    return [step for step, _ in complete_checkpoints(folder / "checkpoint")]


def test_non_finite_loss_stops_with_one_line_and_keeps_last_good_checkpoint(tmp_path, data):
    folder = tmp_path / "run"
    args = train_args(folder, data, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2")
    proc = launch(args, env=child_env(GRAPH_TRAINER_INJECT_NAN_AT_STEP="4"))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = error_lines(proc.stderr)
    assert line.startswith("graph-trainer: error: step 4: loss nan") and "--optimizer.lr" in line
    assert steps_saved(folder) == [2], "step 4 is a save step, but it was not finite: nothing may be saved"
    assert [r["step"] for r in read_metrics(folder)] == [1, 2, 3]


def test_a_segfault_prints_the_python_stack_of_the_step_it_died_in(tmp_path, data):
    proc = launch(train_args(tmp_path / "run", data, "--training.steps", "3"),
                  env=child_env(GRAPH_TRAINER_SIGNAL_AT_STEP="2:SIGSEGV"))
    assert proc.returncode == -signal.SIGSEGV
    report = proc.stderr[proc.stderr.index("Fatal Python error: Segmentation fault"):]
    assert "Current thread" in report
    assert 'graph_trainer/trainer.py", line' in report and "in inject_test_faults" in report
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]


def test_sigterm_stops_after_the_step_saves_and_resumes_bitwise(tmp_path, data):
    common = ["--training.steps", "6", "--checkpoint.interval", "100"]
    straight = losses(run_train(flags(data, *common), tmp_path / "straight"))

    folder = tmp_path / "stopped"
    proc = launch(train_args(folder, data, *common, "--checkpoint.enable"), env=child_env(GRAPH_TRAINER_SIGNAL_AT_STEP="3:SIGTERM"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped after step 3 on a stop signal (SIGTERM)" in proc.stderr
    assert steps_saved(folder) == [3]
    first = losses(read_metrics(folder))
    assert first == straight[:3]

    resumed = [r for r in run_train(flags(data, *common, "--checkpoint.enable"), folder) if r["step"] > 3]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert losses(resumed) == straight[3:]
    assert steps_saved(folder) == [3, 6]


@pytest.mark.slow
def test_sigint_on_one_rank_stops_every_rank_after_the_same_step(tmp_path, data):
    folder = tmp_path / "run"
    args = train_args(folder, data, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "100")
    proc = launch(args, nproc=2, env=child_env(GRAPH_TRAINER_SIGNAL_AT_STEP="2:SIGINT:1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped after step 2 on a stop signal (sent to another rank)" in proc.stderr
    assert steps_saved(folder) == [2]
    assert [r["step"] for r in read_metrics(folder)] == [1, 2]


class Watched:
    """A child process whose stderr is read as it comes, with the time a given line first appeared."""

    def __init__(self, cmd: list[str], env: dict[str, str], marker: str):
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.marker = marker
        self.marker_time: float | None = None
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            if self.marker_time is None and self.marker in line:
                self.marker_time = time.monotonic()
            self.lines.append(line)

    def wait(self, timeout: float) -> tuple[int, float]:
        """Exit code, and seconds from the marker line to the exit."""
        code = self.proc.wait(timeout=timeout)
        end = time.monotonic()
        self.reader.join(timeout=10)
        assert self.marker_time is not None, "".join(self.lines[-40:])
        return code, end - self.marker_time

    @property
    def stderr(self) -> str:
        return "".join(self.lines)


def launch_ranks(args: list[str], nproc: int, **extra: str) -> list[Watched]:
    """Each rank as its own process with the variables torchrun would set, and no torchrun to tear them down."""
    port = str(free_port())
    ranks = []
    for rank in range(nproc):
        env = child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra)
        ranks.append(Watched([sys.executable, "-m", "graph_trainer", *args], env, "step:    1 "))
    return ranks


def stop_all(ranks: list[Watched]) -> None:
    for r in ranks:
        if r.proc.poll() is None:
            os.kill(r.proc.pid, signal.SIGKILL)
            r.proc.wait()


@pytest.mark.parametrize("launcher", ["torchrun", "direct"])
def test_killed_rank_makes_the_others_exit_within_the_timeout(launcher, tmp_path, data):
    timeout_s = 60
    args = train_args(tmp_path / "run", data, "--training.steps", "20", "--parallelism.dp_shard", "2",
                      "--comm.timeout_seconds", str(timeout_s))
    fault = {"GRAPH_TRAINER_SIGNAL_AT_STEP": "2:SIGKILL:1"}
    if launcher == "torchrun":
        cmd = [*torchrun(2), "-m", "graph_trainer", *args]
        ranks = [Watched(cmd, child_env(**fault), "step:    1 ")]
    else:
        ranks = launch_ranks(args, 2, **fault)
    try:
        code, after_step_1 = ranks[0].wait(timeout=300)
    finally:
        stop_all(ranks)
    assert code != 0
    assert after_step_1 < timeout_s, f"rank 0 took {after_step_1:.0f} s to give up on a dead peer"
    (line,) = [line for line in error_lines(ranks[0].stderr) if line.startswith("[rank 0]")]
    assert "a collective failed at step 2" in line and f"--comm.timeout_seconds={timeout_s}" in line
    if launcher == "direct":
        assert code == 4 and "Traceback" not in ranks[0].stderr
        assert ranks[1].proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_silent_rank_makes_the_others_exit_after_the_timeout(tmp_path, data):
    """A stopped (not dead) peer: only the collective timeout can tell; gloo honours it."""
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
    assert "a collective failed at step 2" in line and "Timed out" in line


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
