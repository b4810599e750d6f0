"""`graph-trainer compare`: train one job several ways and report how the runs differ.

    graph-trainer compare --config configs/llama3_debug.toml --nproc 2 --steps 20 --out compare \\
        --runs manual,auto,manual:full --parallelism.dp_shard 2

Every run is `torchrun -m graph_trainer train` with the same config, seed, data and mesh, into
`<out>/runs/NN-<run>/` (emptied first, so nothing of an earlier compare is read back). Flags compare
does not know are passed to every run. A run spec is `PLACEMENT[:BACKEND[:PASSES[:MODE]]]`:

    PLACEMENT  manual (the SimpleFSDP/TP/EP plan) or auto (--compile.autoparallel)
    BACKEND    --compile.inductor_compilation (default none)
    PASSES     --compile.passes joined by '+' (default: the trainer's, the overlap schedule on several
               sharded ranks; `none` for no pass)
    MODE       --compile.mode (default aot_fx_trace)

Empty fields take the default (`manual:::eager`). The spec alone decides those four settings, so the
flags it sets cannot be passed through. Compare checks the grammar, the flags' syntax and the mesh
before any run starts (exit code 2); whether a run can go (pass names and combinations, the solver's
support for the model) is the trainer's check in that run, whose refusal is reported as a failed run.

Writes `<out>/report.md`, `report.json` and PNG plots. Exit code: 0 when every run succeeded, 1 when
any failed (the report says which and why), 2 for bad input to compare itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import Compile, ConfigError, JobConfig, _split_flag, parse_args
from .metrics import read_metrics

PLACEMENTS = ("manual", "auto")
BACKENDS: tuple[str, ...] = typing.get_args(typing.get_type_hints(Compile)["inductor_compilation"])
MODES: tuple[str, ...] = typing.get_args(typing.get_type_hints(Compile)["mode"])
DEFAULT_RUNS = "manual,auto"
SPEC_GRAMMAR = "PLACEMENT[:BACKEND[:PASSES[:MODE]]], e.g. auto, manual:full, manual:none:auto_bucketing or manual:::eager"

# Set by compare for every run (from the run spec or compare's own flags), so refused as pass-through flags.
RESERVED_FLAGS = {
    "compile.mode": "put the mode in --runs, e.g. manual:::eager",
    "compile.inductor_compilation": "put the backend in --runs, e.g. manual:full",
    "compile.passes": "put the passes in --runs, e.g. manual:full:auto_bucketing+cudagraph",
    "compile.autoparallel": "choose the placement in --runs: manual or auto",
    "compile.dump_graphs": "compare always dumps the graphs; drop the flag",
    "job.dump_folder": "use --out",
    "training.steps": "use --steps",
    "metrics.log_freq": "compare logs every step; drop the flag",
}

_STREAMED = re.compile(r"\[graph-trainer\] (.*)")
_ERROR_LINE = "graph-trainer: error:"


@dataclass(frozen=True)
class RunSpec:
    name: str
    """The spec as written on the command line; it names the run in the report."""
    placement: str
    backend: str
    passes: tuple[str, ...]
    mode: str

    def train_flags(self) -> list[str]:
        flags = ["--compile.mode", self.mode, "--compile.inductor_compilation", self.backend,
                 "--compile.passes", ",".join(self.passes)]
        return flags + (["--compile.autoparallel"] if self.placement == "auto" else [])


def parse_run_spec(text: str) -> RunSpec:
    fields = text.split(":")
    if len(fields) > 4:
        raise ConfigError(f"run spec {text!r} has {len(fields)} fields; a run spec is {SPEC_GRAMMAR}")
    placement, backend, passes, mode = fields + [""] * (4 - len(fields))
    backend, mode = backend or "none", mode or "aot_fx_trace"
    for what, value, choices in (("placement", placement, PLACEMENTS), ("backend", backend, BACKENDS), ("mode", mode, MODES)):
        if value not in choices:
            raise ConfigError(f"run spec {text!r}: {what} {value!r} is not one of {', '.join(choices)}; a run spec is {SPEC_GRAMMAR}")
    return RunSpec(text, placement, backend, tuple(p for p in passes.split("+") if p), mode)


def parse_run_specs(text: str) -> list[RunSpec]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError(f"--runs is empty; list run specs separated by commas, each {SPEC_GRAMMAR}")
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"run spec {name!r} is listed {names.count(name)} times in --runs; list each run once")
    return [parse_run_spec(name) for name in names]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"compare: {message}; see graph-trainer compare --help")


def _parser() -> _Parser:
    parser = _Parser(
        prog="graph-trainer compare", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="graph-trainer compare [--config FILE.toml] [--nproc N] [--steps S] [--warmup W] --out DIR [--runs SPEC,...] "
              "[--section.key VALUE ...]",
        description=__doc__)
    parser.add_argument("--config", help="TOML every run loads (default: the one `train` loads)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun --nproc-per-node; default 1)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the tokens/s and MFU medians (default 3)")
    parser.add_argument("--out", required=True, help="folder for the report, the plots and the runs' dump folders")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated run specs (default {DEFAULT_RUNS}), each {SPEC_GRAMMAR}")
    return parser


@dataclass
class CompareJob:
    runs: list[RunSpec]
    configs: list[JobConfig]
    """Each run's resolved config, as its ranks will parse it."""
    nproc: int
    steps: int
    warmup: int
    out: Path
    common_args: list[str]
    """--config and the pass-through flags: the same for every run."""


def check_inputs(argv: list[str]) -> CompareJob:
    """Everything compare can refuse before a run starts, as one-line ConfigErrors."""
    from .validate import _check_writable_folder, check_mesh

    options, passthrough = _parser().parse_known_args(argv)
    if options.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {options.nproc}")
    if options.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {options.warmup}")
    if options.steps <= options.warmup:
        raise ConfigError(f"--steps {options.steps} leaves no step after the {options.warmup} warm-up steps; "
                          f"use --steps {options.warmup + 1} or more, or a smaller --warmup")
    for arg in passthrough:
        if not arg.startswith("--"):
            continue
        name, _ = _split_flag(arg)
        section, _, key = name.partition(".")
        key = key.removeprefix("no_")
        if f"{section}.{key}" in RESERVED_FLAGS:
            raise ConfigError(f"{arg.split('=')[0]} is set by compare for each run; {RESERVED_FLAGS[f'{section}.{key}']}")
    out = Path(options.out)
    _check_writable_folder(out, "--out")
    runs = parse_run_specs(options.runs)
    common_args = (["--config", options.config] if options.config else []) + passthrough
    configs = [parse_args([*common_args, *run.train_flags()]) for run in runs]
    # The flags every run shares decide the mesh, so one check covers them all.
    check_mesh(configs[0], options.nproc)
    return CompareJob(runs, configs, options.nproc, options.steps, options.warmup, out, common_args)


def torchrun(nproc: int) -> list[str]:
    """torchrun on this host. `--standalone` lets its store bind port 0 and hands that port to the
    ranks: a port picked free beforehand can be taken by a concurrent job before torchrun binds it."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def run_folder(out: Path, index: int, run: RunSpec) -> Path:
    return out / "runs" / f"{index:02d}-{re.sub(r'[^A-Za-z0-9_.+-]', '_', run.name)}"


def train_command(job: CompareJob, run: RunSpec, folder: Path) -> list[str]:
    # The run's own flags come last: they win over the config file.
    return [*torchrun(job.nproc), "-m", "graph_trainer", "train", *job.common_args, *run.train_flags(), "--training.steps", str(job.steps),
            "--job.dump_folder", str(folder), "--compile.dump_graphs", "--metrics.log_freq", "1"]


def launch(run: RunSpec, command: list[str], log_path: Path) -> int:
    """Run to the end, keeping all output in `log_path` and echoing the trainer's log lines
    (rank 0's model and step lines, every rank's one-line error) prefixed with the run's name."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("w") as log, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            match = _STREAMED.search(line)
            if match or _ERROR_LINE in line:
                print(f"[{run.name}] {match.group(1) if match else line.strip()}", flush=True)
    return proc.returncode


def error_excerpt(output: str) -> str:
    """The ranks' one-line errors (each distinct one once), else the end of the ranks' output: what
    comes before torchrun's own failure report, which names no cause."""
    lines = output.strip().splitlines()
    errors = list(dict.fromkeys(line[line.index(_ERROR_LINE):] for line in lines if _ERROR_LINE in line))
    if errors:
        return "\n".join(errors)
    torchrun_report = next((i for i, line in enumerate(lines) if "failed (exitcode:" in line), len(lines))
    return "\n".join(lines[:torchrun_report][-15:])


def step_communication(folder: Path, microbatches: int) -> dict[str, dict[str, int]] | None:
    """Collectives per optimizer step by kind, from the graphs that run (the last dumped stage; the last
    forward and backward stages in jit/aot, which dump them apart); None when no graph was dumped (eager)."""
    path = folder / "graphs" / "summary.json"
    if not path.exists():
        return None
    stages = json.loads(path.read_text())["stages"]
    split = any(s["stage"].startswith(("forward", "backward")) for s in stages)
    final = [matching[-1] for kind in (("forward", "backward") if split else ("",))
             if (matching := [s for s in stages if s["stage"].startswith(kind)])]
    total: dict[str, dict[str, int]] = {}
    for stage in final:
        for kind, entry in stage["collectives"].items():
            into = total.setdefault(kind, {"count": 0, "bytes": 0, "buckets": 0})
            for field, value in entry.items():
                into[field] += microbatches * value
    return dict(sorted(total.items()))


def summarize_run(run: RunSpec, cfg: JobConfig, folder: Path, returncode: int, wall_s: float, warmup: int) -> dict[str, Any]:
    records = read_metrics(folder)
    failed = returncode != 0 or not records
    steady = [r for r in records if r["step"] > warmup]
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    first = records[0] if records else {}
    return {
        "name": run.name,
        "placement": run.placement, "backend": run.backend, "passes": list(run.passes), "mode": run.mode,
        "dump_folder": str(folder),
        "status": "failed" if failed else "ok",
        "returncode": returncode,
        "error": error_excerpt((folder / "output.log").read_text()) if failed else None,
        "wall_s": wall_s,
        "steps": len(records),
        "final_loss": records[-1]["loss"] if records else None,
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in steady) if steady else None,
        "mfu": statistics.median(mfus) if mfus else None,
        "peak_memory_gib": max(r["peak_memory_gib"] for r in records) if records else None,
        "first_step_times_s": {k: v for k, v in first.items() if k.endswith("_s") and k != "step_time_s"},
        "communication_per_step": step_communication(folder, cfg.training.gradient_accumulation_steps),
        "metrics": records,
    }


def layout(entry: dict[str, Any] | None) -> str:
    """A parameter's placements on the mesh dims that split anything (size > 1): what makes two runs differ."""
    if entry is None:
        return "absent"
    dims = [f"{name}:{placement}" for name, size, placement in zip(entry["mesh_dim_names"], entry["mesh_shape"], entry["placements"]) if size > 1]
    return ", ".join(dims) or "local"


def placement_diff(reference_folder: Path, folder: Path) -> list[dict[str, str]] | None:
    """Parameters whose layout differs from the reference run's; None when either run wrote no placements."""
    paths = [reference_folder / "placements.json", folder / "placements.json"]
    if not all(p.exists() for p in paths):
        return None
    theirs, ours = (json.loads(p.read_text()) for p in paths)
    rows = []
    for fqn in [*theirs, *(f for f in ours if f not in theirs)]:
        reference, this = layout(theirs.get(fqn)), layout(ours.get(fqn))
        if reference != this:
            rows.append({"parameter": fqn, "reference": reference, "run": this})
    return rows


def compare_to_reference(results: list[dict[str, Any]]) -> str | None:
    """Loss differences and placement differences of every run against the first run that succeeded
    (the first run, unless it failed); returns the reference's name."""
    reference = next((r for r in results if r["status"] == "ok"), None)
    for result in results:
        result["loss_diff"] = result["max_loss_diff"] = result["placement_diff"] = None
        if reference is None:
            continue
        reference_loss = {r["step"]: r["loss"] for r in reference["metrics"]}
        diffs = [{"step": r["step"], "abs_diff": abs(r["loss"] - reference_loss[r["step"]])}
                 for r in result["metrics"] if r["step"] in reference_loss]
        result["loss_diff"] = diffs
        result["max_loss_diff"] = max((d["abs_diff"] for d in diffs), default=None)
        result["placement_diff"] = placement_diff(Path(reference["dump_folder"]), Path(result["dump_folder"]))
    return reference["name"] if reference else None


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (nccl), torch {torch.__version__}"
    return f"cpu (gloo), torch {torch.__version__}"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _bytes(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def _time_keys(results: list[dict[str, Any]]) -> list[str]:
    """First-step times every run may carry, the usual ones first."""
    seen = {k for r in results for k in r["first_step_times_s"]}
    usual = [k for k in ("time_to_first_step_s", "placement_s", "trace_s", "compile_s") if k in seen]
    return usual + sorted(seen - set(usual))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(row) + " |" for row in rows]


def render_markdown(report: dict[str, Any], plots: list[Path]) -> str:
    results, reference = report["runs"], report["reference"]
    others = [r for r in results if reference is not None and r["name"] != reference]
    lines = [
        "# graph-trainer compare", "",
        f"`{report['command']}`", "",
        f"Ranks per run: {report['nproc']}, steps: {report['steps']}, device: {report['device']}. "
        f"Reference run: {reference or 'none (no run succeeded)'}. tokens/s (rank 0's tokens per second) and MFU are "
        f"medians over the steps after the first {report['warmup']}; peak memory is rank 0's maximum over all steps "
        "(GPU: peak active bytes; CPU: peak RSS).", "",
        "## Runs", "",
    ]
    time_keys = _time_keys(results)
    header = ["run", "status", "steps", "final loss", "max abs loss diff", "tokens/s", "MFU %", "peak memory GiB"]
    header += [k.removesuffix("_s").replace("_", " ") + " s" for k in time_keys]
    rows = []
    for r in results:
        status = "ok" if r["status"] == "ok" else f"FAILED (exit {r['returncode']})"
        rows.append([r["name"], status, str(r["steps"]), _number(r["final_loss"], ".5f"), _number(r["max_loss_diff"], ".3g"),
                     _number(r["tokens_per_second"], ",.0f"), _number(r["mfu"], ".2f"), _number(r["peak_memory_gib"], ".2f")]
                    + [_number(r["first_step_times_s"].get(k), ".2f") for k in time_keys])
    lines += _table(header, rows)
    for r in results:
        if r["status"] != "ok":
            lines += ["", f"**{r['name']} failed** (exit code {r['returncode']}; full output: `{r['dump_folder']}/output.log`):",
                      "", "```", r["error"], "```"]

    lines += ["", "## Loss per step" + (f" and its absolute difference to {reference}" if others else ""), ""]
    logged, logged_others = [r for r in results if r["metrics"]], [r for r in others if r["metrics"]]
    losses = [{m["step"]: m["loss"] for m in r["metrics"]} for r in logged]
    diffs = [{d["step"]: d["abs_diff"] for d in r["loss_diff"]} for r in logged_others]
    rows = [[str(step)] + [_number(l.get(step), ".5f") for l in losses] + [_number(d.get(step), ".3g") for d in diffs]
            for step in sorted({s for run_losses in losses for s in run_losses})]
    lines += _table(["step"] + [r["name"] for r in logged] + [f"\\|diff\\| {r['name']}" for r in logged_others], rows)

    lines += ["", "## Communication per step", "",
              "Collectives in the step graph of rank 0 (count, and bytes each rank holds after them: gathered tensors "
              "for all-gather, shards for reduce-scatter), times the microbatches of a step. `-`: no graph (eager) or failed run.", ""]
    kinds = sorted({k for r in results for k in (r["communication_per_step"] or {})})
    rows = []
    for r in results:
        comm = r["communication_per_step"]
        rows.append([r["name"]] + ["-" if comm is None else (f"{comm[k]['count']} x, {_bytes(comm[k]['bytes'])}" if k in comm else "0")
                                   for k in kinds])
    lines += _table(["run"] + kinds, rows) if kinds else ["No collectives in any step graph."]

    if others:
        lines += ["", f"## Placements that differ from {reference}", "",
                  "Each parameter's placements on the mesh dims of size > 1 (`local`: no such dim), from `placements.json`."]
    for r in others:
        rows = r["placement_diff"]
        lines.append("")
        if rows is None:
            lines.append(f"**{r['name']}**: no placements.json to compare.")
        elif not rows:
            lines.append(f"**{r['name']}**: same placements as {reference} for every parameter.")
        else:
            lines += [f"**{r['name']}**: {len(rows)} parameters differ.", ""]
            lines += _table(["parameter", reference, r["name"]], [[row["parameter"], row["reference"], row["run"]] for row in rows])

    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def cmd_compare(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    job = check_inputs(argv)
    results = []
    for index, (run, cfg) in enumerate(zip(job.runs, job.configs), start=1):
        folder = run_folder(job.out, index, run)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        command = train_command(job, run, folder)
        print(f"[compare] run {index}/{len(job.runs)} {run.name}: {shlex.join(command)}", flush=True)
        start = time.perf_counter()
        returncode = launch(run, command, folder / "output.log")
        result = summarize_run(run, cfg, folder, returncode, time.perf_counter() - start, job.warmup)
        outcome = "ok" if result["status"] == "ok" else f"FAILED (exit {returncode}): {result['error'].splitlines()[-1]}"
        print(f"[compare] run {index}/{len(job.runs)} {run.name}: {outcome} in {result['wall_s']:.1f} s", flush=True)
        results.append(result)

    from .compare_plots import plot_runs

    report = {"command": shlex.join(["graph-trainer", "compare", *argv]), "device": _device(), "nproc": job.nproc,
              "steps": job.steps, "warmup": job.warmup, "reference": compare_to_reference(results), "runs": results}
    (job.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    plots = plot_runs(results, job.warmup, job.out)
    (job.out / "report.md").write_text(render_markdown(report, plots))
    failed = [r["name"] for r in results if r["status"] != "ok"]
    print(f"[compare] report: {job.out / 'report.md'}, {job.out / 'report.json'}, plots: {', '.join(p.name for p in plots)}")
    if failed:
        print(f"[compare] failed runs: {', '.join(failed)}", flush=True)
    return 1 if failed else 0
