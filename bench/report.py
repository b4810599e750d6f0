"""A suite's results as `<out>/<date>-<suite>.json`, `.md` (tables) and `.png` (throughput and memory; loss curves of
runs compared over a curve)."""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

from kernel_mix import KINDS, OTHER
from logs import main_protocols
from runs import WARMUP_STEPS

SPEC_PEAK_NOTE = ("MFU is against the dense bf16 peak of the spec sheet (989 TFLOP/s for H100 SXM and H200, torchtitan's table); "
                  "peak memory is the allocator's peak active bytes on both sides.")


def add_ratios(results: list[dict]) -> list[dict]:
    """Throughput (and active memory) against the torchtitan runs of the same group."""
    for r in results:
        base = next((b for b in results if b["group"] == r["group"] and b["name"] == "titan eager" and b.get("tokens_per_second")), None)
        if base and r.get("tokens_per_second"):
            r["ratio_to_titan_eager"] = r["tokens_per_second"] / base["tokens_per_second"]
        compiled = next((b for b in results if b["group"] == r["group"] and b["name"] == "titan compile" and b.get("tokens_per_second")), None)
        if compiled and r.get("tokens_per_second"):
            r["ratio_to_titan_compile"] = r["tokens_per_second"] / compiled["tokens_per_second"]
            if r.get("peak_memory_gib") and compiled.get("peak_memory_gib"):
                r["memory_ratio_to_titan_compile"] = r["peak_memory_gib"] / compiled["peak_memory_gib"]
    return results


def _fmt(r: dict, key: str, spec: str, scale: float = 1.0) -> str:
    return format(r[key] * scale, spec) if r.get(key) is not None else "-"


def _verdict(r: dict) -> str:
    if r.get("reference_missing"):
        return f"- (no {r['bitwise_with']} run)"
    if "bitwise_equal" not in r:
        return "-"
    if r["bitwise_equal"]:
        return "yes"
    if "within_loss_bound" in r:
        verdict = "within" if r["within_loss_bound"] else "OUTSIDE"
        mean, most = r["loss_bound"]
        return (f"no; absolute loss difference: step 1 {r['first_step_abs_loss_diff']:.1e}, mean {r['mean_abs_loss_diff']:.1e}, "
                f"max {r['max_abs_loss_diff']:.1e}: {verdict} the bound (mean {mean:g}, max {most:g})")
    if "bound" in r:
        verdict = "within" if r["max_rel_diff"] <= r["bound"] else "OUTSIDE"
        return f"no; max rel diff {r['max_rel_diff']:.1e}, {verdict} the {r['bound']:g} bound"
    return f"NO (vs {r['bitwise_with']})"


def _short_by_design(r: dict) -> bool:
    """A run asked for no more steps than the warm-up (an export for others to start from), all of them taken."""
    args = r.get("args", [])
    asked = int(args[args.index("--training.steps") + 1]) if "--training.steps" in args else None
    return r.get("returncode") == 0 and asked is not None and r.get("steps") == asked <= WARMUP_STEPS


def _status(r: dict) -> str:
    cause = [line for line in r.get("error", "").splitlines() if "ChildFailedError" not in line and "lspci" not in line]
    status = "ok" if r.get("tokens_per_second") or _short_by_design(r) else "failed: " + (cause or [""])[-1][:100].replace("|", "/")
    if status == "ok" and r.get("returncode"):
        # steps measured, then no clean exit (a hang at teardown ends in the timeout's kill, -9)
        status = f"ok, then exit code {r['returncode']}"
    if status.startswith("ok") and any(math.isnan(x) for x in r.get("losses", [])):
        # NaN operands run GEMMs at higher clocks (bench/fake_data_check.py): not comparable with a finite run
        status = "ok, losses NaN: speed inflated"
    return status


def _exposed(r: dict) -> str:
    # the trace's reading (share of the kernel span, both trainers) where there is one; older results have our
    # profiler's (share of the profiled wall step), marked
    if r.get("trace_exposed_comm_share") is not None:
        return f"{100 * r['trace_exposed_comm_share']:.1f}"
    return f"{100 * r['exposed_comm_share']:.1f} (wall)" if r.get("exposed_comm_share") is not None else "-"


def _runs_table(results: list[dict]) -> list[str]:
    lines = ["| group | run | tokens/s/GPU | MFU % | peak active GiB | first step s | launch to step 1 s | exposed comm % | "
             "NCCL protocol (by bytes) | vs titan eager | vs titan compile | memory vs titan compile | bitwise | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        protocol = main_protocols(r["nccl_protocols"]) if r.get("nccl_protocols") else "-"
        lines.append(f"| {r['group']} | {r['name']} | {_fmt(r, 'tokens_per_second', ',.0f')} | {_fmt(r, 'mfu', '.1f')} | "
                     f"{_fmt(r, 'peak_memory_gib', '.1f')} | {_fmt(r, 'time_to_first_step_s', '.0f')} | "
                     f"{_fmt(r, 'launch_to_first_step_s', '.0f')} | {_exposed(r)} | {protocol} | {_fmt(r, 'ratio_to_titan_eager', '.2f')} | "
                     f"{_fmt(r, 'ratio_to_titan_compile', '.2f')} | {_fmt(r, 'memory_ratio_to_titan_compile', '.2f')} | {_verdict(r)} | {_status(r)} |")
    return lines


def _table(intro: str, columns: list[str], rows: list[str]) -> list[str]:
    """A titled markdown table; nothing without rows."""
    if not rows:
        return []
    return ["", intro, "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|", *rows]


def _solver_table(results: list[dict]) -> list[str]:
    predicted = [r for r in results if r.get("predicted_step_s") and r.get("step_time_s")]
    return _table("Auto-placed runs: the solver's predicted step (compute + optimizer + serial communication, plan.json) against "
                  "the measured median step:", ["run", "predicted ms", "measured ms", "predicted / measured"],
                  [f"| {r['name']} | {1e3 * r['predicted_step_s']:.1f} | {1e3 * r['step_time_s']:.1f} | "
                   f"{r['predicted_step_s'] / r['step_time_s']:.2f} |" for r in predicted])


def _fake(r: dict) -> bool:
    return "--comm.mode" in r["args"] and r["args"][r["args"].index("--comm.mode") + 1] == "fake"


def _projected_table(results: list[dict]) -> list[str]:
    projected = [r for r in results if r.get("predicted_compute_ms") is not None and r.get("step_time_s") and _fake(r)]
    if not projected:
        return []
    lines = ["", "Fake-communication runs measure one rank's compute; the cost model (prediction.json) adds the communication "
                 "the REAL job would leave exposed after bucketing and overlap: projected real step = measured step + "
                 "predicted exposed communication.", "",
             "| group | run | measured step ms | predicted compute ms | predicted / measured | predicted exposed comm ms | "
             "projected real step ms | projected tokens/s/GPU | bandwidths |", "|---|---|---|---|---|---|---|---|---|"]
    for r in projected:
        measured = 1e3 * r["step_time_s"]
        real = measured + r["predicted_exposed_comm_ms"]
        lines.append(f"| {r['group']} | {r['name']} | {measured:.1f} | {r['predicted_compute_ms']:.1f} | "
                     f"{r['predicted_compute_ms'] / measured:.2f} | {r['predicted_exposed_comm_ms']:.1f} | {real:.1f} | "
                     f"{r['tokens_per_second'] * measured / real:,.0f} | {json.dumps(r.get('prediction_bandwidths'))} |")
    return lines


PREDICTION_TOLERANCE = (0.20, 0.02)
"""The cost model's exposed communication counts as right within 20% of the measured, or 2% of the step."""


def _exposed_prediction_table(results: list[dict]) -> list[str]:
    """Real-communication runs, profiled: the cost model's exposed communication against the trace's."""
    rows = [r for r in results if r.get("predicted_exposed_comm_ms") is not None and r.get("trace_exposed_comm_ms") is not None
            and not _fake(r)]
    if not rows:
        return []
    lines = ["", "Exposed communication, predicted by the cost model (prediction.json) against measured from the profile "
                 "(collective kernel time no compute kernel overlaps, rank 0's trace); right within "
                 f"{100 * PREDICTION_TOLERANCE[0]:.0f}% or {100 * PREDICTION_TOLERANCE[1]:.0f}% of the kernel span:", "",
             "| group | run | kernel span ms | measured exposed ms | by NCCL operation ms | by tenth of the span ms | predicted exposed ms | predicted by kind ms | predicted compute ms | verdict | all-to-all verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        measured, predicted, span = r["trace_exposed_comm_ms"], r["predicted_exposed_comm_ms"], r["trace_kernel_span_ms"]
        by_op = "; ".join(f"{op} {ms:.1f}" for op, ms in r.get("trace_exposed_by_collective_ms", {}).items() if ms >= 0.05) or "-"
        by_part = " ".join(f"{ms:.1f}" for ms in r.get("trace_exposed_by_part_ms", [])) or "-"
        by_kind = r.get("predicted_exposed_by_kind_ms", {})
        predicted_kinds = "; ".join(f"{kind} {ms:.1f}" for kind, ms in by_kind.items() if ms >= 0.05) or "-"
        # NCCL runs an all-to-all as point-to-point sends: its kernels are the trace's SendRecv
        exchange = ("-" if "all_to_all" not in by_kind else
                    _prediction_verdict(r.get("trace_exposed_by_collective_ms", {}).get("SendRecv", 0.0), by_kind["all_to_all"], span))
        lines.append(f"| {r['group']} | {r['name']} | {span:.1f} | {measured:.1f} | {by_op} | {by_part} | {predicted:.1f} | {predicted_kinds} | "
                     f"{r['predicted_compute_ms']:.1f} | {_prediction_verdict(measured, predicted, span)} | {exchange} |")
    return lines


def _prediction_verdict(measured: float, predicted: float, span: float) -> str:
    miss = abs(predicted - measured)
    return "within" if miss <= PREDICTION_TOLERANCE[0] * measured or miss <= PREDICTION_TOLERANCE[1] * span else "OUTSIDE"


def _pipelined(r: dict) -> bool:
    return any(flag in r["args"] for flag in ("--parallelism.pp", "--parallelism.pipeline_parallel_degree"))


def _bubble_table(results: list[dict]) -> list[str]:
    """Pipeline runs, profiled: the part of the step no compute kernel ran on rank 0 (the first stage), from its trace."""
    rows = [r for r in results if _pipelined(r) and r.get("trace_compute_idle_ms") is not None]
    return _table("Pipeline bubble of one profiled step on rank 0 (the first stage): kernel span time no compute kernel ran "
                  "(waiting on the other stage, or on exposed communication), from the trace (bench/kernel_mix.py):",
                  ["group", "run", "layers per stage", "kernel span ms", "compute idle ms", "bubble %", "exposed comm %"],
                  [f"| {r['group']} | {r['name']} | {r.get('pp_stage_layers', '-')} | {r['trace_kernel_span_ms']:.1f} | "
                   f"{r['trace_compute_idle_ms']:.1f} | {100 * r['trace_compute_idle_share']:.1f} | {_exposed(r)} |" for r in rows])


def _compile_table(results: list[dict]) -> list[str]:
    """Where the time to the first step went, for runs that compiled with full Inductor: the compile cache's outcome
    (a restart loads what the cold run stored) and how many distinct blocks Inductor compiled for how many layers."""
    rows = [r for r in results if r.get("compile_cache") or r.get("compiled_blocks")]
    if not rows:
        return []
    lines = ["", "Time to the first step of the full-Inductor runs (the first step's record in metrics.jsonl; trace, the graph "
             "passes before the decomposition, the decomposition with the distinct pieces it decomposed (and the pieces compile "
             "workers compiled in it, with their number), Inductor, and the "
             "host time of the first call and of the first clip + update; trace is the load of the stored trace where the "
             "trace cache hit, and a miss stores the trace in the time after it, or the load of the step and its compiled "
             "pieces where the step cache hit (no trace, no pass); where make_fx ran fewer blocks than the "
             "model has, the others repeated from them, their number follows the trace's time):", "",
             "| group | run | compile cache | step cache | trace cache | blocks compiled / layers | trace s | trace stored s | "
             "passes s | decomposition s (pieces) | Inductor compile (or cache load) s | first call + update s | first step s | "
             "launch to step 1 s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        blocks = f"{r['compiled_blocks']} / {r['layers']}" if r.get("compiled_blocks") else "-"
        passes = [v for k, v in r.items() if k.startswith("pass_") and k not in ("pass_inductor_decomposition_s",
                                                                                "pass_full_inductor_compilation_s")]
        pieces = f" ({r['decomposed_pieces']})" if "decomposed_pieces" in r else ""
        if r.get("compile_workers"):
            pieces += f", {r.get('worker_compiled_pieces', 0)} by {r['compile_workers']} workers"
        first = r["first_call_s"] + r["optimizer_s"] if "first_call_s" in r and "optimizer_s" in r else None
        traced = f" ({r['traced_blocks']} blocks)" if r.get("traced_blocks", r.get("layers")) != r.get("layers") else ""
        lines.append(f"| {r['group']} | {r['name']} | {r.get('compile_cache', '-')} | {r.get('step_cache', '-')} | "
                     f"{r.get('trace_cache', '-')} | {blocks} | "
                     f"{_fmt(r, 'trace_s', '.1f')}{traced} | {_fmt(r, 'trace_store_s', '.1f')} | {sum(passes):.1f} | {_fmt(r, 'pass_inductor_decomposition_s', '.1f')}{pieces} | "
                     f"{_fmt(r, 'pass_full_inductor_compilation_s', '.1f')} | {'-' if first is None else f'{first:.1f}'} | "
                     f"{_fmt(r, 'time_to_first_step_s', '.1f')} | {_fmt(r, 'launch_to_first_step_s', '.1f')} |")
    titans = [r for r in results if r["trainer"] == "titan" and r.get("launch_to_first_step_s")]
    lines += [f"| {r['group']} | {r['name']} | - | - | - | - | - | - | - | - | - | - | - | {r['launch_to_first_step_s']:.1f} |" for r in titans]
    return lines


def _top_kernels(results: list[dict]) -> list[str]:
    lines = []
    for r in results:
        # profiles recorded before kernel-time shares existed gave shares of the profiler-slowed wall time
        if not r.get("top_kernels") or "kernel_ms" not in r:
            continue
        lines += ["", f"Top kernels of one profiled step, {r['group']}: {r['name']} ({r['profiled_step_ms']:.1f} ms, "
                      f"kernels busy {r['busy_ms']:.1f} ms, kernel time {r['kernel_ms']:.1f} ms):", "",
                  "| kernel | calls | ms | share of kernel time |", "|---|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['count']} | {k['ms_per_step']:.2f} | {100 * k['share_of_kernel_time']:.1f}% |" for k in r["top_kernels"]]
    return lines


def _kernel_mix_tables(results: list[dict]) -> list[str]:
    """Per group, the profiled runs' kernel time by kind side by side (ms per step)."""
    lines = []
    for group in dict.fromkeys(r["group"] for r in results if r.get("kernel_mix")):
        runs = [r for r in results if r["group"] == group and r.get("kernel_mix")]
        lines += ["", f"Kernel time of one profiled step by kind, {group} (ms; bench/kernel_mix.py):", "",
                  "| kind | " + " | ".join(r["name"] for r in runs) + " |", "|---" * (len(runs) + 1) + "|"]
        for kind in [k for k, _ in KINDS] + [OTHER]:
            if any(r["kernel_mix"].get(kind) for r in runs):
                lines.append(f"| {kind} | " + " | ".join(f"{r['kernel_mix'].get(kind, 0.0):.1f}" for r in runs) + " |")
        lines.append("| total | " + " | ".join(f"{sum(r['kernel_mix'].values()):.1f}" for r in runs) + " |")
    return lines


def write_report(results: list[dict], suite: str, out: Path, device: str, commands: list[str]) -> Path:
    results = add_ratios(results)
    stem = out / f"{datetime.date.today().isoformat()}-{suite}"
    stem.with_suffix(".json").write_text(json.dumps({"suite": suite, "device": device, "commands": commands,
                                                     "results": results}, indent=2) + "\n")
    lines = [f"# {suite} on {device}", "", "Made by:", "", *[f"    {c}" for c in commands], "", SPEC_PEAK_NOTE,
             "Exposed comm %: collective kernel time no compute kernel overlaps, over the step's kernel span, from the "
             "profiled step's trace (bench/kernel_mix.py).", "", *_runs_table(results)]
    lines += _compile_table(results) + _bubble_table(results) + _solver_table(results) + _projected_table(results) + _exposed_prediction_table(results)
    lines += _top_kernels(results) + _kernel_mix_tables(results)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(results, stem)
    return stem


def _plot(results: list[dict], stem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.get("tokens_per_second")]
    if ok:
        fig, axes = plt.subplots(1, 2, figsize=(14, max(3, 0.45 * len(ok))))
        labels = [f"{r['group']}: {r['name']}" for r in ok]
        axes[0].barh(labels, [r["tokens_per_second"] for r in ok])
        axes[0].set_xlabel("tokens/s per GPU (median, steady steps)")
        axes[1].barh(labels, [r["peak_memory_gib"] or 0.0 for r in ok])
        axes[1].set_xlabel("peak active memory GiB")
        axes[1].set_yticklabels([])
        fig.tight_layout()
        fig.savefig(stem.with_suffix(".png"), dpi=90)
        plt.close(fig)
    curves = list(dict.fromkeys(r["group"] for r in results if "loss_bound" in r))
    if curves:
        fig, axes = plt.subplots(1, len(curves), figsize=(7 * len(curves), 4), squeeze=False)
        for ax, group in zip(axes[0], curves):
            for r in results:
                if r["group"] == group and len(r["losses"]) > 1:
                    ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["name"], linewidth=1)
            ax.set_title(group)
            ax.set_xlabel("step")
            ax.set_ylabel("loss")
            ax.legend()
        fig.tight_layout()
        fig.savefig(stem.parent / f"{stem.name}-losses.png", dpi=90)
        plt.close(fig)
