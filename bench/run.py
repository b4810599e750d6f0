"""GPU benchmark suites: torchtitan 0.2.2's own trainer and graph-trainer's modes/backends on the same
device, model, batch and tokens, in one call. Writes `<out>/<date>-<suite>.json`, `.md` and PNG plots.

    python bench/run.py --suite h100 --out $OUT          # one H100
    python bench/run.py --suite h200x2 --out $OUT        # two H200 (nvidia-h200-x2)
    python bench/run.py --suite h100 --tiny --out /tmp/b # CPU dry run of the graph-trainer runs

A suite longer than one device call runs in parts (`--groups` or `--only`); a later part takes the
earlier parts' JSON with `--merge`, so the last call writes the whole suite's report (a run measured
in several parts keeps its latest result).

Throughput is the median tokens/s per GPU of the steps after the warm-up; MFU is against the dense bf16
peak of the spec sheet (989 TFLOP/s for H100 SXM and H200, torchtitan's table); peak memory is the
allocator's peak active bytes for graph-trainer and the peak reserved bytes torchtitan logs. Runs marked
`profile` profile their second-to-last step (graph-trainer's --profiling: exposed communication and the
top kernels go into the report; that step is left out of the throughput median).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from graph_trainer.compare import free_port
from graph_trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 3


@dataclass
class Run:
    name: str
    trainer: str  # "gt" or "titan"
    nproc: int
    args: list[str]
    bitwise_with: str = ""
    """Name of an earlier run whose losses this one must equal bit for bit."""
    group: str = ""
    env: dict = field(default_factory=dict)
    profile: bool = False
    """Profile one steady step (graph-trainer's --profiling): exposed communication and top kernels."""


def _gt(name: str, group: str, base: list[str], extra: list[str], nproc: int = 1, bitwise_with: str = "",
        env: dict | None = None, profile: bool = False) -> Run:
    return Run(name, "gt", nproc, base + extra, bitwise_with, group, env or {}, profile)


def _titan(name: str, group: str, flavor: str, batch: int, seq: int, steps: int, nproc: int, extra: list[str],
           model: str = "gt_llama3") -> Run:
    args = ["--model.name", model, "--model.flavor", flavor, "--training.local_batch_size", str(batch),
            "--training.seq_len", str(seq), "--training.steps", str(steps), "--metrics.log_freq", "1",
            "--model.hf_assets_path", str(REPO / "graph_trainer/data/assets"), "--experimental.custom_import",
            "bench.titan_spec", "--activation_checkpoint.mode", "none", *extra]
    return Run(name, "titan", nproc, args, group=group)


def suite_h100(steps: int) -> list[Run]:
    one_b = ["--model.flavor", "1B", "--training.seq_len", "4096", "--training.batch_size", "4", "--training.steps",
             str(steps), "--training.random_tokens", "--training.no-deterministic", "--metrics.log_freq", "1"]
    debug = ["--model.flavor", "debugmodel", "--training.seq_len", "2048", "--training.batch_size", "8",
             "--training.steps", str(steps * 2), "--training.random_tokens", "--training.deterministic"]
    flex = [*debug[:1], "debugmodel_flex_attn", *debug[2:]]
    deepseek = ["--model.name", "deepseek_v3", *debug]
    # Bitwise pairs run deterministic kernels; batch 2 because unfused FX execution needs more memory.
    bitwise_1b = ["--model.flavor", "1B", "--training.seq_len", "4096", "--training.batch_size", "2", "--training.steps",
                  "5", "--training.random_tokens"]
    trace = ["--compile.mode", "aot_fx_trace"]
    full = [*trace, "--compile.inductor_compilation", "full"]
    tuned = {"TORCHINDUCTOR_MAX_AUTOTUNE_GEMM": "1"}
    simple_fsdp = ["--job.custom_config_module", "torchtitan.experiments.simple_fsdp.job_config", "--compile.enable"]
    return [
        _titan("titan eager", "1B", "1B", 4, 4096, steps, 1, []),
        _titan("titan compile", "1B", "1B", 4, 4096, steps, 1, ["--compile.enable"]),
        _titan("titan simple_fsdp compile", "1B", "1B", 4, 4096, steps, 1, simple_fsdp, model="gt_simple_fsdp_llama3"),
        _gt("gt eager", "1B", one_b, ["--compile.mode", "eager"]),
        _gt("gt jit full", "1B", one_b, ["--compile.mode", "jit", "--compile.inductor_compilation", "full"]),
        _gt("gt aot full", "1B", one_b, ["--compile.mode", "aot", "--compile.inductor_compilation", "full"]),
        _gt("gt aot_fx_trace full", "1B", one_b, full, profile=True),
        _gt("gt aot_fx_trace autoparallel_backend", "1B", one_b, trace + ["--compile.inductor_compilation", "autoparallel_backend"]),
        _gt("gt aot_fx_trace regional", "1B", one_b, trace + ["--compile.inductor_compilation", "regional"]),
        _gt("gt aot_fx_trace full + cudagraph", "1B", one_b, full + ["--compile.passes", "cudagraph"]),
        _gt("gt aot_fx_trace full tuned kernels", "1B", one_b, full, env=tuned),
        _gt("gt aot_fx_trace full auto-placed", "1B", one_b, full + ["--compile.autoparallel"], profile=True),
        _gt("gt eager deterministic", "1B bitwise", bitwise_1b, ["--compile.mode", "eager"]),
        _gt("gt aot_fx_trace deterministic", "1B bitwise", bitwise_1b, trace, bitwise_with="gt eager deterministic"),
        _gt("gt debug eager", "debug", debug, ["--compile.mode", "eager"]),
        _gt("gt debug aot_fx_trace", "debug", debug, trace, bitwise_with="gt debug eager"),
        _gt("gt debug full", "debug", debug, full),
        _gt("gt debug full + cudagraph", "debug", debug, full + ["--compile.passes", "cudagraph"], bitwise_with="gt debug full"),
        _gt("gt deepseek eager", "deepseek debug", deepseek, ["--compile.mode", "eager"]),
        _gt("gt deepseek aot_fx_trace", "deepseek debug", deepseek, trace, bitwise_with="gt deepseek eager"),
        _gt("gt deepseek aot_fx_trace auto-placed", "deepseek debug", deepseek, trace + ["--compile.autoparallel"]),
        _gt("gt flex eager", "debug flex", flex, ["--compile.mode", "eager"]),
        _gt("gt flex aot_fx_trace", "debug flex", flex, trace),
        _gt("gt flex aot_fx_trace regional", "debug flex", flex, trace + ["--compile.inductor_compilation", "regional"]),
        _gt("gt flex aot_fx_trace full", "debug flex", flex, full),
    ]


def suite_h200x2(steps: int) -> list[Run]:
    eight_b = ["--model.flavor", "8B", "--training.seq_len", "8192", "--training.batch_size", "2", "--training.steps",
               str(steps), "--training.random_tokens", "--training.no-deterministic", "--parallelism.dp_shard", "2",
               "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"]
    trace = ["--compile.mode", "aot_fx_trace"]
    return [
        _titan("titan eager", "8B", "8B", 1, 8192, steps, 2, ["--activation_checkpoint.mode", "selective"]),
        _titan("titan compile", "8B", "8B", 1, 8192, steps, 2, ["--activation_checkpoint.mode", "selective", "--compile.enable"]),
        _gt("gt eager", "8B", eight_b, ["--compile.mode", "eager"], nproc=2),
        _gt("gt aot_fx_trace full + auto_bucketing", "8B", eight_b,
            trace + ["--compile.inductor_compilation", "full", "--compile.passes", "auto_bucketing"], nproc=2),
        _gt("gt aot_fx_trace autoparallel_backend", "8B", eight_b, trace + ["--compile.inductor_compilation", "autoparallel_backend"], nproc=2),
        _gt("gt auto-placed autoparallel_backend", "8B", eight_b,
            trace + ["--compile.inductor_compilation", "autoparallel_backend", "--compile.autoparallel"], nproc=2),
    ]


SUITES = {"h100": suite_h100, "h200x2": suite_h200x2}


def _profiling_args(run: Run) -> list[str]:
    steps = int(run.args[run.args.index("--training.steps") + 1])
    return ["--profiling.enable", "--profiling.start_step", str(steps - 1), "--profiling.steps", "1"] if run.profile else []


def _command(run: Run, dump: Path) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(run.nproc), "--master-port", str(free_port())]
    if run.trainer == "gt":
        return launcher + ["-m", "graph_trainer", "train", "--job.dump_folder", str(dump), *run.args, *_profiling_args(run)]
    return launcher + ["-m", "torchtitan.train", "--job.dump_folder", str(dump), *run.args]


_TITAN_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _records(run: Run, dump: Path, output: str) -> list[dict]:
    if run.trainer == "gt":
        return read_metrics(dump)
    records = []
    for line in _ANSI.sub("", output).splitlines():
        m = _TITAN_LINE.search(line)
        if m:
            records.append({"step": int(m[1]), "loss": float(m[2]), "peak_memory_gib": float(m[3]),
                            "tokens_per_second": float(m[4].replace(",", "")), "mfu": float(m[5])})
    return records


def _error_lines(output: str) -> str:
    """The rank's own error lines, not torchrun's failure banner."""
    lines = [l for l in output.splitlines() if re.search(r"(Error|error:|Exception)", l) and "elastic" not in l]
    return "\n".join(lines[-6:]) or "\n".join(output.splitlines()[-15:])


def _profile(dump: Path) -> dict:
    path = dump / "profile" / "summary.json"
    if not path.exists():
        return {}
    summary = json.loads(path.read_text())
    return {"exposed_comm_share": summary["exposed_comm_share"], "profiled_step_ms": summary["step_time_ms"],
            "busy_ms": summary["busy_ms"], "top_kernels": summary["top_kernels"][:8]}


def _prediction(dump: Path) -> dict:
    """The solver's predicted step of an auto-placed run (plan.json beside its metrics)."""
    path = dump / "plan.json"
    if not path.exists():
        return {}
    predicted = json.loads(path.read_text())["predicted"]
    return {"predicted_step_s": predicted["compute_and_optimizer_s"] + predicted["communication_s"]}


def summarize(run: Run, records: list[dict], wall_s: float, rc: int, tail: str) -> dict:
    steady = [r for r in records if r["step"] > WARMUP_STEPS and not r.get("profiled")] or records
    out = {"name": run.name, "group": run.group, "trainer": run.trainer, "nproc": run.nproc, "args": run.args,
           "returncode": rc, "wall_s": round(wall_s, 1), "steps": len(records),
           "losses": [r["loss"] for r in records], "grad_norms": [r.get("grad_norm") for r in records]}
    if not records:
        out["error"] = tail
        return out
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    out.update(
        tokens_per_second=statistics.median(r["tokens_per_second"] for r in steady),
        mfu=statistics.median(mfus) if mfus else None,
        peak_memory_gib=max(r["peak_memory_gib"] for r in records),
        step_time_s=statistics.median(r["step_time_s"] for r in steady) if all("step_time_s" in r for r in steady) else None,
        time_to_first_step_s=records[0].get("time_to_first_step_s"),
    )
    return out


def run_suite(runs: list[Run], runs_dir: Path, timeout: int, earlier: list[dict], report: Callable[[list[dict]], Any]) -> list[dict]:
    """Run each in turn; the report is rewritten after every run, so a call cut short keeps what ran."""
    results: list[dict] = list(earlier)
    for run in runs:
        dump = runs_dir / re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{run.group}-{run.name}")
        print(f"== {run.group}: {run.name}", flush=True)
        start = time.perf_counter()
        try:
            proc = subprocess.run(_command(run, dump), cwd=REPO, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, **run.env})
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, output = -9, f"timed out after {timeout}s\n" + ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "log.txt").write_text(output)
        result = summarize(run, _records(run, dump, output), time.perf_counter() - start, rc, _error_lines(output))
        result.update(_profile(dump), **_prediction(dump), env=run.env)
        if run.bitwise_with:
            ref = next((r for r in results if r["name"] == run.bitwise_with and r["group"] == run.group), None)
            result["bitwise_with"] = run.bitwise_with
            result["bitwise_equal"] = bool(ref and ref["losses"] and (ref["losses"], ref.get("grad_norms")) == (result["losses"], result["grad_norms"]))
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "args")}), flush=True)
        report(add_ratios(results))
    return add_ratios(results)


def add_ratios(results: list[dict]) -> list[dict]:
    for r in results:
        base = next((b for b in results if b["group"] == r["group"] and b["name"] == "titan eager" and b.get("tokens_per_second")), None)
        if base and r.get("tokens_per_second"):
            r["ratio_to_titan_eager"] = r["tokens_per_second"] / base["tokens_per_second"]
    return results


def write_report(results: list[dict], suite: str, out: Path, device: str, commands: list[str]) -> Path:
    stem = out / f"{datetime.date.today().isoformat()}-{suite}"
    stem.with_suffix(".json").write_text(json.dumps({"suite": suite, "device": device, "commands": commands,
                                                     "results": results}, indent=2) + "\n")
    lines = [f"# {suite} on {device}", "", "Made by:", "", *[f"    {c}" for c in commands], "",
             "| group | run | tokens/s/GPU | MFU % | peak mem GiB | first step s | exposed comm % | vs titan eager | bitwise | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        def fmt(key, spec, scale=1.0):
            return format(r[key] * scale, spec) if r.get(key) is not None else "-"
        bitwise = "-" if "bitwise_equal" not in r else ("yes" if r["bitwise_equal"] else f"NO (vs {r['bitwise_with']})")
        cause = [line for line in r.get("error", "").splitlines() if "ChildFailedError" not in line and "lspci" not in line]
        status = "ok" if r.get("tokens_per_second") else "failed: " + (cause or [""])[-1][:100].replace("|", "/")
        lines.append(f"| {r['group']} | {r['name']} | {fmt('tokens_per_second', ',.0f')} | {fmt('mfu', '.1f')} | "
                     f"{fmt('peak_memory_gib', '.1f')} | {fmt('time_to_first_step_s', '.0f')} | {fmt('exposed_comm_share', '.1f', 100)} | "
                     f"{fmt('ratio_to_titan_eager', '.2f')} | {bitwise} | {status} |")
    predicted = [r for r in results if r.get("predicted_step_s") and r.get("step_time_s")]
    if predicted:
        lines += ["", "Auto-placed runs: the solver's predicted step (compute + optimizer + serial communication, "
                      "plan.json) against the measured median step:", "",
                  "| run | predicted ms | measured ms | predicted / measured |", "|---|---|---|---|"]
        lines += [f"| {r['name']} | {1e3 * r['predicted_step_s']:.1f} | {1e3 * r['step_time_s']:.1f} | "
                  f"{r['predicted_step_s'] / r['step_time_s']:.2f} |" for r in predicted]
    for r in results:
        if not r.get("top_kernels"):
            continue
        lines += ["", f"Top kernels of one profiled step, {r['group']}: {r['name']} ({r['profiled_step_ms']:.1f} ms, "
                      f"kernels busy {r['busy_ms']:.1f} ms):", "", "| kernel | calls | ms | share of step |", "|---|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['count']} | {k['ms_per_step']:.2f} | {100 * k['share_of_step']:.1f}% |" for k in r["top_kernels"]]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(results, stem)
    return stem


def _plot(results: list[dict], stem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.get("tokens_per_second")]
    if not ok:
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, max(3, 0.45 * len(ok))))
    labels = [f"{r['group']}: {r['name']}" for r in ok]
    axes[0].barh(labels, [r["tokens_per_second"] for r in ok])
    axes[0].set_xlabel("tokens/s per GPU (median, steady steps)")
    axes[1].barh(labels, [r["peak_memory_gib"] for r in ok])
    axes[1].set_xlabel("peak memory GiB")
    axes[1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=list(SUITES), required=True)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--groups", default="", help="comma-separated run groups (default: all)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per run")
    parser.add_argument("--runs-dir", default="", help="where the runs' dump folders go (default: a temporary folder)")
    parser.add_argument("--merge", nargs="*", default=[],
                        help="JSON results of earlier calls to put in front of this one's; without --only/--groups, only merge")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: graph-trainer runs on the debug model, fp32")
    a = parser.parse_args()
    runs = SUITES[a.suite](a.steps)
    if a.only:
        runs = [r for r in runs if r.name in set(a.only.split(","))]
    if a.groups:
        runs = [r for r in runs if r.group in set(a.groups.split(","))]
    if a.merge and not (a.only or a.groups):
        runs = []
    if a.tiny:
        runs = [_tiny(r) for r in runs if r.trainer == "gt"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    earlier = [json.loads(Path(p).read_text()) for p in a.merge]
    import torch

    device = torch.cuda.get_device_name() + f" x{torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    device = f"{device}, torch {torch.__version__}" if runs or not earlier else earlier[0]["device"]
    if any(e["device"] != device for e in earlier):
        parser.error(f"--merge: results from another device than {device}")
    # a later part that ran a run again replaces the earlier result of that run
    results = list({(r["group"], r["name"]): r for e in earlier for r in e["results"]}.values())
    commands = [c for e in earlier for c in e.get("commands", [e.get("command", "")])]
    commands.append(" ".join(["python", *sys.argv]))
    if runs:
        runs_dir = Path(a.runs_dir or tempfile.mkdtemp(prefix="bench-runs-"))
        results = run_suite(runs, runs_dir, a.timeout, results, lambda done: write_report(done, a.suite, out, device, commands))
    stem = write_report(add_ratios(results), a.suite, out, device, commands)
    print((stem.with_suffix(".md")).read_text())
    return 0


def _tiny(run: Run) -> Run:
    args = list(run.args)
    for flag, value in (("--model.flavor", "debugmodel"), ("--training.seq_len", "64"), ("--training.batch_size", "4"),
                        ("--training.steps", "5")):
        if flag in args:
            args[args.index(flag) + 1] = value
    if "cudagraph" in args:
        i = args.index("cudagraph")
        del args[i - 1 : i + 1]
    return Run(run.name, run.trainer, run.nproc, args + ["--training.mixed_precision_param", "float32"], run.bitwise_with,
               run.group, run.env, run.profile)


if __name__ == "__main__":
    raise SystemExit(main())
