"""Shared test helpers: run the CLI in subprocesses (one rank or torchrun) and read what it wrote."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from graph_trainer.compare import torchrun
from graph_trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def launch(args: list[str], nproc: int = 1, timeout: int = TIMEOUT_S, env: dict[str, str] | None = None,
           script: str | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`graph-trainer <args>` (or `python <script> <args>`) on one process, or under torchrun with `nproc` ranks, in
    the folder `cwd`. A run of the CLI in the tests' own environment is forked by this worker's launcher (zygote.py),
    which has imported graph_trainer already; any other starts afresh."""
    program = [script] if script else ["-m", "graph_trainer"]
    if nproc == 1:
        cmd = [sys.executable, *program, *args]
    else:
        cmd = [*torchrun(nproc), *program, *args]
    run_env = env or child_env()
    socket_path = _zygote(run_env) if script is None else None
    if socket_path is not None:
        return _launch_in_zygote(socket_path, cmd, args, nproc, run_env, timeout, cwd)
    return subprocess.run(cmd, cwd=cwd, env=run_env, capture_output=True, text=True, timeout=timeout)


_ZYGOTE: list[tuple[subprocess.Popen, str | None, dict[str, str]]] = []
_ZYGOTE_LOCK = threading.Lock()


def _zygote(env: dict[str, str]) -> str | None:
    """The socket of this test process's launcher, started on first use in `env`; None where a run must start
    afresh: another environment than the launcher imported torch in, or no launcher (it failed to start)."""
    with _ZYGOTE_LOCK:
        if not _ZYGOTE:
            path = os.path.join(tempfile.mkdtemp(prefix="gt-zygote-"), "socket")
            proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "zygote.py"), path], cwd=REPO, env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            ready = proc.stdout.readline().strip() == "ready"
            _ZYGOTE.append((proc, path if ready else None, env))
        proc, path, started_in = _ZYGOTE[0]
    same = _imported_with(started_in) == _imported_with(env)
    return path if path is not None and same and proc.poll() is None else None


def _imported_with(env: dict[str, str]) -> dict[str, str]:
    """What of an environment the launcher's imports could have read: all but pytest's name of the running test."""
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


def _launch_in_zygote(path: str, cmd: list[str], args: list[str], nproc: int, env: dict[str, str],
                      timeout: int, cwd: Path) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="gt-run-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        out.touch()
        err.touch()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(path)
            request = {"argv": args, "nproc": nproc, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply = conn.makefile()
            manager = int(reply.readline())
            try:
                line = reply.readline()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(manager, signal.SIGKILL)
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(errors="replace"), err.read_text(errors="replace")) from None
        # no answer: the run's manager itself died
        code = int(line) if line.strip() else -signal.SIGKILL
        return subprocess.CompletedProcess(cmd, code, out.read_text(errors="replace"), err.read_text(errors="replace"))


def ranks_report(test_file: str, nproc: int = 2) -> list[str]:
    """Run a test module's `__main__` under torchrun on `nproc` gloo ranks; the words its ranks printed, sorted (one
    `rank<r>:<checks>` each). Fails the test with the ranks' stderr where one failed."""
    proc = subprocess.run([*torchrun(nproc), str(REPO / "tests" / test_file)], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return sorted(proc.stdout.split())


def run_train(args: list[str], dump_folder: Path, nproc: int = 1, timeout: int = TIMEOUT_S) -> list[dict]:
    """Train and return the metrics records; fails the test with the run's output tail on error."""
    proc = launch(["train", "--job.dump_folder", str(dump_folder), *args], nproc=nproc, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{_fatal(proc.stderr)}{proc.stderr[-5000:]}")
    return read_metrics(dump_folder)


def _fatal(stderr: str) -> str:
    """A crashed rank's Python stacks (faulthandler's report), which the list of extension modules after them
    and torchrun's summary push out of the output's tail."""
    start = stderr.find("Fatal Python error")
    if start < 0:
        return ""
    end = stderr.find("Extension modules", start)
    return stderr[start:end if end > 0 else start + 6000] + "\n...\n"


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def grad_norms(records: list[dict]) -> list[float]:
    return [r["grad_norm"] for r in records]


_ROOT: list[Path] = []


def _run_root() -> Path:
    """Where cached runs live: one folder per test session, which pytest-xdist's workers share (they
    share its test-run id), so a run two test files ask for trains once."""
    session = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if session is None:
        if not _ROOT:
            _ROOT.append(Path(tempfile.mkdtemp(prefix="gt-runs-")))
        return _ROOT[0]
    root = Path(tempfile.gettempdir()) / f"gt-runs-{session}"
    root.mkdir(exist_ok=True)
    return root


def cached_run(args: tuple[str, ...], nproc: int = 1) -> Path:
    """Train once per (args, nproc) per test session and return the dump folder: parity tests share
    their reference runs, across test files and workers. A worker that asks for a run another is
    training waits for it; a folder without its completion mark (a failed run) is trained again."""
    key = hashlib.sha1(repr((args, nproc)).encode()).hexdigest()[:16]
    folder = _run_root() / key
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder / ".complete"
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            run_train(list(args), folder, nproc=nproc)
            done.touch()
    return folder


def cached_train(args: tuple[str, ...], nproc: int = 1) -> list[dict]:
    return read_metrics(cached_run(args, nproc))
