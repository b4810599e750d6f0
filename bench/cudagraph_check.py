"""GPU check of the `cudagraph` pass: llama3 debugmodel trained with `--compile.mode aot_fx_trace`,
without and with `--compile.passes cudagraph`, for each backend asked for. Losses and gradient norms
must be bitwise equal; the step-time speed-up is printed. Every run has a hard timeout, so a hang
(at capture or at exit) fails the check instead of stalling it.

    python bench/cudagraph_check.py                      # one GPU, backends none and full
    python bench/cudagraph_check.py --nproc 2            # dp_shard=2: collectives inside the graph
    python bench/cudagraph_check.py --backends none --steps 30 --out $OUT

Exit code 0 when every pair matches and exits cleanly, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from graph_trainer.compare import torchrun
from graph_trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
TIMED_FROM_STEP = 4
"""Step 1 warms up and step 2 captures: time the steps from here on."""


def train(folder: Path, args: list[str], nproc: int, timeout: int) -> tuple[list[dict], float]:
    """Run one training job; return its metrics records and its wall time."""
    cmd = [sys.executable, "-m", "graph_trainer", "train"]
    if nproc > 1:
        cmd = [*torchrun(nproc), "-m", "graph_trainer", "train"]
    cmd += ["--job.dump_folder", str(folder), "--metrics.progress_bar", "false", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"FAIL: {' '.join(args)} did not finish within {timeout}s (hang at capture or exit?)")
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"FAIL: {' '.join(args)} exited with {proc.returncode}")
    records = read_metrics(folder)
    return records, wall


def median_step_s(records: list[dict]) -> float:
    return statistics.median(r["step_time_s"] for r in records if r["step"] >= TIMED_FROM_STEP)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backends", default="none,full", help="comma-separated --compile.inductor_compilation values")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per training run")
    parser.add_argument("--out", default="", help="folder for the runs' dump folders (default: a temporary one)")
    opts = parser.parse_args()
    if opts.steps < TIMED_FROM_STEP + 2:
        parser.error(f"--steps must be at least {TIMED_FROM_STEP + 2}")
    root = Path(opts.out or tempfile.mkdtemp(prefix="cudagraph-check-"))
    base = ["--model.name", "llama3", "--model.flavor", "debugmodel", "--compile.mode", "aot_fx_trace",
            "--training.steps", str(opts.steps), "--parallelism.dp_shard", str(opts.nproc), "--metrics.log_freq", "1"]
    failed = False
    print(f"{'backend':8} {'ranks':>5} {'step ms':>9} {'cudagraph ms':>13} {'speed-up':>9} {'wall s':>7} {'cg wall s':>9}  losses")
    for backend in opts.backends.split(","):
        args = [*base, "--compile.inductor_compilation", backend]
        plain, plain_wall = train(root / f"{backend}_plain", args, opts.nproc, opts.timeout)
        graphed, graphed_wall = train(root / f"{backend}_cudagraph", [*args, "--compile.passes", "cudagraph"], opts.nproc, opts.timeout)
        same = [r["loss"] for r in plain] == [r["loss"] for r in graphed] and \
               [r["grad_norm"] for r in plain] == [r["grad_norm"] for r in graphed]
        failed |= not same or len(graphed) != opts.steps
        t_plain, t_graphed = median_step_s(plain), median_step_s(graphed)
        print(f"{backend:8} {opts.nproc:>5} {t_plain * 1e3:>9.2f} {t_graphed * 1e3:>13.2f} {t_plain / t_graphed:>8.2f}x "
              f"{plain_wall:>7.1f} {graphed_wall:>9.1f}  {'bitwise equal' if same else 'DIFFER'}")
        if not same:
            for a, b in zip(plain, graphed):
                print(f"   step {a['step']}: loss {a['loss']!r} vs {b['loss']!r}, grad_norm {a['grad_norm']!r} vs {b['grad_norm']!r}")
    print("FAIL" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
