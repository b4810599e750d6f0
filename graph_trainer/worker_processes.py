"""The processes of a rank's compile workers (passes/compile_workers.py hands them pieces), started as early as a
job allows.

A worker imports torch, Inductor and graph_trainer, then warms up (compile_worker_process.py): on one H200 (llama3 8B
as one rank of dp_shard 8, fake communication) that took 13.9-18.6 s from its start, while the rank sent the first
piece 10.9-15.1 s after it: started where the step is about to be traced, the workers were what the compile waited
for. So `graph-trainer train` starts them right after reading its flags (`start_early`), before the rank's own
imports (11.8-13.4 s there), where the job will want them: the traced step with full Inductor (or
`autoparallel_backend`) compiled by pieces, on a GPU (`worker_count`, or `--compile.compile_workers N`), with a
compile cache that holds no traced step yet (a restart loads its pieces and needs none). The compile adopts them
(`adopt`); any not adopted are stopped when the run ends.

This module imports nothing heavy itself (the decision imports torch, which every job imports first anyway).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AUTO = -1
THREADS = 2
"""Processes each worker builds its Triton kernels with (`TORCHINDUCTOR_COMPILE_THREADS`, unless set). On 16 cores
(one H200, llama3 8B): 8 workers of 2 reached the first step in 27.0 s, 4 of 4 in 27.4 s, 15 of 1 in 31.6 s (their
imports slowed the trace beside them), none in 40.4 s (bench/scripts/compile_workers_sweep.sh)."""


def worker_count(asked: int, device_type: str) -> int:
    """How many workers `--compile.compile_workers` asks for on this rank (0: none). Auto, on a GPU rank: one per
    `THREADS` cores where the rank is alone on its node; where it shares the node, its share of the cores over
    `2 * THREADS`, since every rank compiles every piece and traces beside its workers (2 x H200, 32 cores, llama3 8B
    cut to 16 layers at dp_shard 2: 4 workers a rank reached the first step in 18.4 s, 8 in 20.3 s, none in 27.3 s,
    bench/results/2026-11-29-session20; on 4 H200s, 8 a rank were slower than none, before the workers started with
    the job: 2026-11-28-compile-workers)."""
    if asked != AUTO:
        return asked
    if device_type != "cuda":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ranks == 1:
        return max(1, cores // THREADS)
    return cores // ranks // (2 * THREADS)


@dataclass
class Processes:
    device: str
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="graph_trainer_workers.")))
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    def stop(self) -> None:
        """Kill the workers (idle, compiling or still importing) and remove their folder. All are killed before any is
        waited for: each one's exit tears down its CUDA context, and one after the other the 8 workers of an H200 took
        1.0-1.3 s of the first step's wait (bench/results/2026-11-29-session19)."""
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:  # a line written to a worker that died is not flushed anywhere
                    pass
        shutil.rmtree(self.folder, ignore_errors=True)


def spawn(count: int, device: str) -> Processes:
    """Start `count` worker processes for pieces compiled on `device`."""
    processes = Processes(device)
    env = {"TORCHINDUCTOR_COMPILE_THREADS": str(THREADS), **os.environ}
    code = f"from graph_trainer.passes.compile_worker_process import serve; serve({device!r})"
    try:
        for i in range(count):
            log = processes.folder / f"worker{i}.log"
            processes.logs.append(log)
            with open(log, "w") as err:
                processes.procs.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                        stderr=err, env=env, text=True, bufsize=1))
    except OSError:
        processes.stop()
        raise
    return processes


_early: Processes | None = None


def start_early(cfg: Any) -> None:
    """Start this rank's workers now where the job will want them (see the module docstring)."""
    global _early
    from .config import CACHED_BACKENDS, cache_folder
    from .defaults import resolved_backend

    c = cfg.compile
    folder = cache_folder(cfg)
    if _early is not None or c.mode != "aot_fx_trace" or not c.block_reuse or c.passes or folder is None:
        return
    if any((folder / "traces").glob("*.bin")):
        return
    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    count = worker_count(c.compile_workers, device_type)
    if count and resolved_backend(cfg, device_type) in CACHED_BACKENDS:
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if device_type == "cuda" else "cpu"
        try:
            _early = spawn(count, device)
        except OSError:
            _early = None


def adopt(count: int, device: str) -> Processes | None:
    """The workers `start_early` started, where they are `count` for `device` (else they are stopped): the caller
    owns them from here."""
    global _early
    early, _early = _early, None
    if early is not None and (len(early.procs) != count or early.device != device):
        early.stop()
        return None
    return early


def stop_early() -> None:
    """Stop the workers `start_early` started that no compile adopted."""
    global _early
    if _early is not None:
        _early.stop()
        _early = None
