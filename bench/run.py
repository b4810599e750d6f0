"""GPU benchmark suites: torchtitan 0.2.2's own trainer and graph-trainer's modes/backends on the same
device, model, batch and tokens, in one call. Writes `<out>/<date>-<suite>.json`, `.md` and PNG plots (`multi`:
`<date>-multi-<N>gpu.*`).

    python bench/run.py --suite h100 --out $OUT          # one H100
    python bench/run.py --suite multi --groups "8B-16L dp2" --steps 10 --out $OUT  # all GPUs of the machine, NCCL
    python bench/run.py --suite numerics --out $OUT      # 2 GPUs: same weights as torchtitan; bitwise traced steps
    python bench/run.py --suite scale --groups "8B dp8" --out $OUT  # one config of N ranks on one H200
    python bench/run.py --suite multi --tiny --gpus 2 --out /tmp/b  # CPU dry run of the graph-trainer runs (gloo)
    python bench/run.py --suite multi --gpus 4 --print-commands     # every run's command line, torchtitan's too

A suite longer than one device call runs in parts (`--groups` or `--only`); a later part takes the
earlier parts' JSON with `--merge`, so the last call writes the whole suite's report (a run measured
in several parts keeps its latest result).

Throughput is the median tokens/s per GPU of the steps after the warm-up; MFU is against the dense bf16
peak of the spec sheet (989 TFLOP/s for H100 SXM and H200, torchtitan's table); peak memory is the
allocator's peak active bytes on both sides (torchtitan's through bench/titan_spec.py). Runs marked
`profile` profile their second-to-last step (graph-trainer's --profiling) or, torchtitan's, their last
(two steps added for the profiler); profiled steps are left out of the throughput median, and both
trainers' kernel time by kind and exposed communication come from their traces (`bench/kernel_mix.py`).
Time to first step is measured by the runner for both trainers, from launch to the line of step 1.

Modules: runs.py (what a run is), suites/ (the runs of each suite), runner.py (launching and reading
back), logs.py (the trainers' output), report.py (json, md, png), kernel_mix.py (traces).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from report import write_report
from runner import against_reference, command, run_suite
from runs import WARMUP_STEPS, last_measured_step, steps_of, tiny
from suites import GPU_COUNTS, SUITES


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        fail(message)


def fail(message: str):
    print(f"bench/run.py: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def main() -> int:
    parser = _OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=list(SUITES), required=True)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", default="", help="comma-separated run names, run in this order (default: all)")
    parser.add_argument("--groups", default="", help="comma-separated run groups (default: all)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per run")
    parser.add_argument("--runs-dir", default="", help="where the runs' dump folders go (default: a temporary folder)")
    parser.add_argument("--merge", nargs="*", default=[],
                        help="JSON results of earlier calls to put in front of this one's; without --only/--groups, only merge")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: graph-trainer runs on the debug model, fp32")
    parser.add_argument("--gpus", type=int, default=0,
                        help="GPUs the multi-GPU suites' configs are for (default: every GPU of this machine; 2 on a CPU)")
    parser.add_argument("--print-commands", action="store_true", help="print every selected run's command line and exit")
    parser.add_argument("--bytecode-cache", action="store_true",
                        help="let every run read Python bytecode compiled once, under the runs folder, where the environment "
                             "forbids writing it (PYTHONDONTWRITEBYTECODE): as a pip-installed machine has it")
    a = parser.parse_args()
    import torch

    gpus = a.gpus or torch.cuda.device_count() or 2
    if a.suite in GPU_COUNTS and gpus not in GPU_COUNTS[a.suite]:
        fail(f"--suite {a.suite} has configs for {' or '.join(map(str, GPU_COUNTS[a.suite]))} GPUs, not {gpus}: "
             f"pass --gpus {GPU_COUNTS[a.suite][0]} (and run on such a machine)")
    runs = SUITES[a.suite](a.steps, gpus)
    groups = set(a.groups.split(",")) if a.groups else set()
    names = a.only.split(",") if a.only else []
    unknown = sorted(groups - {r.group for r in runs}) + [n for n in names if n not in {r.name for r in runs}]
    if unknown:
        fail(f"--suite {a.suite} has no run or group {unknown[0]!r}: see --print-commands for its groups and runs")
    if names:
        # in the order given: a call that may run out of time runs what matters most first
        runs = sorted((r for r in runs if r.name in names), key=lambda r: names.index(r.name))
    if groups:
        runs = [r for r in runs if r.group in groups]
    if a.merge and not (a.only or a.groups):
        runs = []
    if a.tiny:
        runs = [tiny(r) for r in runs if r.trainer == "gt"]
    short = next((r for r in runs if last_measured_step(r) <= WARMUP_STEPS), None)
    if short is not None:
        fail(f"--steps {a.steps} leaves {short.group}: {short.name} ({steps_of(short)} steps{', profiled' if short.profile else ''}) "
             f"no step to measure after the {WARMUP_STEPS}-step warm-up: pass a larger --steps")
    runs_dir = Path(a.runs_dir or tempfile.mkdtemp(prefix="bench-runs-"))
    if a.bytecode_cache:
        # the warm-up import before the first run compiles it; every trainer's process (and its workers) reads it
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = str(runs_dir / "pycache")
    if a.print_commands:
        for r in runs:
            env = " ".join(f"{k}={v}" for k, v in r.env.items())
            print(f"# {r.group}: {r.name}\n{env + ' ' if env else ''}{shlex.join(command(r, runs_dir))}")
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    earlier = [json.loads(Path(p).read_text()) for p in a.merge]
    device = torch.cuda.get_device_name() + f" x{torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    device = f"{device}, torch {torch.__version__}" if runs or not earlier else earlier[0]["device"]
    if any(e["device"] != device for e in earlier):
        fail(f"--merge: results from another device than {device}; merge only results of this machine kind")
    # a later part that ran a run again replaces the earlier result of that run
    results = list({(r["group"], r["name"]): r for e in earlier for r in e["results"]}.values())
    # merged results are judged again by the suite's current references and bounds (the measurements stay as they were)
    defined = {(r.group, r.name): r for r in SUITES[a.suite](a.steps, gpus)}
    for result in results:
        run = defined.get((result["group"], result["name"]))
        if run is not None and run.bitwise_with:
            result.update(against_reference(run, result, results))
    commands = [c for e in earlier for c in e.get("commands", [e.get("command", "")])]
    commands.append(" ".join(["python", *sys.argv]))
    # the configs of a suite by GPU count differ: one report each
    name = f"{a.suite}-{gpus}gpu" if a.suite in GPU_COUNTS else a.suite
    if runs:
        results = run_suite(runs, runs_dir, a.timeout, results, lambda done: write_report(done, name, out, device, commands))
    stem = write_report(results, name, out, device, commands)
    print((stem.with_suffix(".md")).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
