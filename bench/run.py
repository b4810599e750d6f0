"""GPU benchmark suites: torchtitan 0.2.2's own trainer and graph-trainer's modes/backends on the same
device, model, batch and tokens, in one call. Writes `<out>/<date>-<suite>.json`, `.md` and PNG plots.

    python bench/run.py --suite h100 --out $OUT          # one H100
    python bench/run.py --suite h200x2 --out $OUT        # two H200 (nvidia-h200-x2)
    python bench/run.py --suite h100 --tiny --out /tmp/b # CPU dry run of the graph-trainer runs
    python bench/run.py --suite scale --groups "8B dp8" --out $OUT  # one config of N ranks on one H200

A suite longer than one device call runs in parts (`--groups` or `--only`); a later part takes the
earlier parts' JSON with `--merge`, so the last call writes the whole suite's report (a run measured
in several parts keeps its latest result).

Throughput is the median tokens/s per GPU of the steps after the warm-up; MFU is against the dense bf16
peak of the spec sheet (989 TFLOP/s for H100 SXM and H200, torchtitan's table); peak memory is the
allocator's peak active bytes for graph-trainer and the peak reserved bytes torchtitan logs. Runs marked
`profile` profile their second-to-last step (graph-trainer's --profiling: exposed communication and the
top kernels go into the report) or, torchtitan's, their last (two steps added for the profiler); profiled
steps are left out of the throughput median, and both trainers' kernel time by kind goes into the report
(`bench/kernel_mix.py`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from graph_trainer.compare import torchrun
from graph_trainer.metrics import read_metrics
from kernel_mix import KINDS, OTHER, kernel_mix

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
    """Profile one steady step: graph-trainer's --profiling (exposed communication, top kernels), torchtitan's
    profiler on its last step; both give the step's kernel time by kind (`kernel_mix`)."""
    torchrun: bool = True
    """False: one plain process (a fake-communication run of one rank of a larger job)."""
    bound: float = 0.0
    """With `bitwise_with`: where the kernels differ (Inductor fuses what eager runs op by op), the largest
    relative difference of losses and grad norms allowed; 0 asks for bitwise equality."""


def _gt(name: str, group: str, base: list[str], extra: list[str], nproc: int = 1, bitwise_with: str = "",
        env: dict | None = None, profile: bool = False) -> Run:
    return Run(name, "gt", nproc, base + extra, bitwise_with, group, env or {}, profile)


def _titan(name: str, group: str, flavor: str, batch: int, seq: int, steps: int, nproc: int, extra: list[str],
           model: str = "gt_llama3", profile: bool = False) -> Run:
    # a profiled run's last two steps (profiler warm-up, recorded step) are not measured: two more steps
    args = ["--model.name", model, "--model.flavor", flavor, "--training.local_batch_size", str(batch),
            "--training.seq_len", str(seq), "--training.steps", str(steps + 2 * profile), "--metrics.log_freq", "1",
            "--model.hf_assets_path", str(REPO / "graph_trainer/data/assets"), "--experimental.custom_import",
            "bench.titan_spec", "--activation_checkpoint.mode", "none", *extra]
    return Run(name, "titan", nproc, args, group=group, profile=profile)


META_PLACED = ["--compile.autoparallel", "--compile.autoparallel_impl", "meta"]
MEMORY_BUDGET = ["--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget"]
"""Followed by the budget, e.g. "36GiB"."""


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
    in_graph_optimizer = ["--compile.optimizer_in_graph"]
    fused_loss = ["--training.loss", "fused_linear_ce"]
    simple_fsdp = ["--job.custom_config_module", "torchtitan.experiments.simple_fsdp.job_config", "--compile.enable"]
    # rank 0 of 8 under fake communication (the scale suite's 8B dp8 job), on this one GPU
    eight_b_fake = ["--model.flavor", "8B", "--training.seq_len", "8192", "--training.batch_size", "8", "--training.steps", str(steps),
                    "--training.random_tokens", "--training.no-deterministic", "--metrics.log_freq", "1", "--comm.mode", "fake",
                    "--comm.fake_world_size", "8", "--parallelism.dp_shard", "8", "--activation_checkpoint.mode", "selective",
                    "--activation_checkpoint.selective_ac_option", "2"]
    return [
        _titan("titan eager", "1B", "1B", 4, 4096, steps, 1, []),
        _titan("titan compile", "1B", "1B", 4, 4096, steps, 1, ["--compile.enable"], profile=True),
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
        # Whole-step levers on the 1B, alone and combined, beside torchtitan compile in the same call.
        _titan("titan compile", "levers", "1B", 4, 4096, steps, 1, ["--compile.enable"]),
        _gt("gt aot_fx_trace full", "levers", one_b, full),
        _gt("gt full + optimizer_in_graph", "levers", one_b, full + in_graph_optimizer),
        _gt("gt full + fused loss", "levers", one_b, full + fused_loss),
        _gt("gt full + fused loss chunk 8192", "levers", one_b, full + fused_loss + ["--training.loss_chunk_tokens", "8192"]),
        # The 1B keeps 21.3 GiB of parameters, gradients and AdamW state: 36 / 30 GiB leave 14.7 / 8.7 GiB
        # for saved activations (35 GiB without AC, as the pass counts them before Inductor).
        _gt("gt full + memory_budget 36GiB", "levers", one_b, full + MEMORY_BUDGET + ["36GiB"], profile=True),
        _gt("gt full + memory_budget 30GiB", "levers", one_b, full + MEMORY_BUDGET + ["30GiB"]),
        _gt("gt full + optimizer_in_graph + fused loss", "levers", one_b, full + in_graph_optimizer + fused_loss, profile=True),
        _gt("gt full + optimizer_in_graph + fused loss + memory_budget", "levers", one_b,
            full + in_graph_optimizer + fused_loss + ["--activation_checkpoint.mode", "memory_budget"]),
        # Meta's AutoParallel placing the model (needs its da99589 wheel carried: README, "Meta's AutoParallel")
        _gt("gt aot_fx_trace full", "meta", one_b, full),
        _gt("gt aot_fx_trace meta-placed", "meta", one_b, trace + META_PLACED),
        _gt("gt aot_fx_trace full meta-placed", "meta", one_b, full + META_PLACED),
        Run("gt aot_fx_trace full", "gt", 1, eight_b_fake + full, group="meta 8B dp8 fake", torchrun=False),
        # Meta's placed forward is its own graph, which block AC never reaches: both sides under the memory policy
        Run("gt full + memory_budget 45GiB", "gt", 1, eight_b_fake + full + MEMORY_BUDGET + ["45GiB"], group="meta 8B dp8 fake",
            torchrun=False),
        Run("gt full meta-placed + memory_budget 45GiB", "gt", 1, eight_b_fake + full + META_PLACED + MEMORY_BUDGET + ["45GiB"],
            group="meta 8B dp8 fake", torchrun=False),
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


@dataclass
class ScaleConfig:
    group: str
    ranks: int
    model: str
    flavor: str
    local_batch: int
    seq: int
    gt_mesh: list[str]
    titan_mesh: list[str]
    ac: str
    step_scale: float
    """Steps as a multiple of --steps / 12."""
    layers: int = 0
    """Cut the flavor to this many layers (0: all), torchtitan's too (bench.titan_spec's `<flavor>-<layers>L`):
    the per-layer work of a deep model, profiled in a fraction of the call."""
    profile_all: bool = False
    """Profile every graph-trainer run (else only the best configuration)."""
    memory_budgets: tuple[str, ...] = ()
    """Runs of the memory policy (`--activation_checkpoint.mode memory_budget`) in place of `ac`, at these budgets."""
    profiled_budget: str = ""
    """The one of them profiled."""


# the issue's four configs, and 70B cut to 8 layers to profile where its step goes
SCALE_CONFIGS = [
    # The budget bounds the step's peak as the memory policy simulates it on the traced step before Inductor: at
    # 8B dp8 79.3 GiB without AC (11.2 GiB of parameters, AdamW moments and batch held throughout; 57.3 GiB of
    # activations). Predicted on CPU (bench/predict_on_meta.py, h200): selective AC 929 ms of compute, 42 GiB 896
    # ms, 45 GiB 877 ms; Inductor's fusion leaves the measured peak some GiB under the simulated one.
    ScaleConfig("8B dp8", 8, "llama3", "8B", 1, 8192, ["--parallelism.dp_shard", "8"],
                ["--parallelism.data_parallel_shard_degree", "8"], "selective", 1.0,
                memory_budgets=("42GiB", "43GiB", "44GiB", "45GiB"), profiled_budget="45GiB"),
    # where the rank has memory to spare (titan compile reserves 32.6 GiB of 139.8): selective AC 489 ms of compute;
    # the simulated step without AC peaks at 57.0 GiB; 40 GiB recomputes 53 ms' worth (475 ms), 48 GiB 7.5 ms' (432 ms)
    ScaleConfig("8B dp4 tp2", 8, "llama3", "8B", 1, 8192, ["--parallelism.dp_shard", "4", "--parallelism.tp", "2"],
                ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.tensor_parallel_degree", "2"], "selective", 1.0,
                memory_budgets=("40GiB", "48GiB"), profiled_budget="48GiB"),
    # predicted 7,687 ms of compute at 62 GiB (torchtitan compile reserves 62.9), 7,429 at 80 GiB, full AC 8,305
    ScaleConfig("70B dp32", 32, "llama3", "70B", 1, 8192, ["--parallelism.dp_shard", "32"],
                ["--parallelism.data_parallel_shard_degree", "32"], "full", 0.5, memory_budgets=("62GiB", "80GiB")),
    ScaleConfig("70B dp32 8 layers", 32, "llama3", "70B", 1, 8192, ["--parallelism.dp_shard", "32"],
                ["--parallelism.data_parallel_shard_degree", "32"], "full", 1.0, layers=8, profile_all=True),
    # capacity factor 2 as configs/deepseek_v3_16b.toml: at 0 (never drop) every dispatch buffer is sized for
    # all tokens and rank 0 needs 140.6 GiB (measured: the one-line refusal); drops are counted per step
    ScaleConfig("DeepSeek 16B dp8 ep8", 8, "deepseek_v3", "16B", 4, 4096, ["--parallelism.dp_shard", "8", "--parallelism.ep", "8",
                                                                        "--parallelism.moe_capacity_factor", "2.0"],
                ["--parallelism.data_parallel_shard_degree", "8", "--parallelism.expert_parallel_degree", "8"], "none", 1.0),
]


def suite_scale(steps: int) -> list[Run]:
    """One rank of an N-rank job on one GPU: torchtitan under `--comm.mode fake_backend` (NGPU=N, rank 0, no
    torchrun) beside graph-trainer under `--comm.mode fake`. Each group fits one 10-minute device call."""
    runs = []
    for c in SCALE_CONFIGS:
        group, ranks, model, flavor, local_batch, seq, gt_mesh, ac = c.group, c.ranks, c.model, c.flavor, c.local_batch, c.seq, c.gt_mesh, c.ac
        n = max(WARMUP_STEPS + 2, round(steps * c.step_scale * 8 / 12))
        dp = ranks // 2 if "--parallelism.tp" in gt_mesh else ranks
        ac_flags = ["--activation_checkpoint.mode", ac] + (["--activation_checkpoint.selective_ac_option", "2"] if ac == "selective" else [])
        base = ["--model.name", model, "--model.flavor", flavor, "--training.seq_len", str(seq), "--training.batch_size",
                str(dp * local_batch), "--training.steps", str(n), "--training.random_tokens", "--training.no-deterministic",
                "--metrics.log_freq", "1", "--comm.mode", "fake", "--comm.fake_world_size", str(ranks), *gt_mesh, *ac_flags,
                *(["--model.n_layers", str(c.layers)] if c.layers else [])]
        titan_model = "gt_deepseek_v3" if model == "deepseek_v3" else "gt_llama3"
        titan = ["--comm.mode", "fake_backend", *c.titan_mesh, *ac_flags]
        fake_env = {"NGPU": str(ranks), "LOCAL_RANK": "0", "RANK": "0"}

        def titan_run(name: str, extra: list[str], titan_model: str = titan_model, profile: bool = False) -> Run:
            titan_flavor = f"{flavor}-{c.layers}L" if c.layers else flavor
            run = _titan(name, group, titan_flavor, local_batch, seq, n, 1, titan + extra, model=titan_model, profile=profile)
            return replace(run, env=fake_env, torchrun=False)

        trace = ["--compile.mode", "aot_fx_trace"]
        full = [*trace, "--compile.inductor_compilation", "full"]
        if model == "llama3" and ranks <= 8:
            runs.append(titan_run("titan eager", []))
        # profiled: the reference's kernel time by kind, beside our full Inductor's
        runs.append(titan_run("titan compile", ["--compile.enable"], profile=True))
        if group == "8B dp8":
            runs.append(titan_run("titan simple_fsdp compile", ["--job.custom_config_module", "torchtitan.experiments.simple_fsdp.job_config",
                                                                "--compile.enable"], "gt_simple_fsdp_llama3"))
        for name, extra in (("gt eager", ["--compile.mode", "eager"]), ("gt aot_fx_trace full", full),
                            ("gt aot_fx_trace autoparallel_backend", trace + ["--compile.inductor_compilation", "autoparallel_backend"]),
                            ("gt aot_fx_trace full auto-placed", full + ["--compile.autoparallel"])):
            # full Inductor is the reference of every config: profiled, so a miss has its top kernels
            runs.append(Run(name, "gt", 1, base + extra, group=group, torchrun=False,
                            profile=c.profile_all or name == "gt aot_fx_trace full"))
        # our best configuration on every config, profiled (the report's top kernels say where its time goes)
        # (the fused loss needs the whole vocabulary on the rank: not under TP)
        if "--parallelism.tp" in gt_mesh:
            runs.append(Run("gt full + optimizer_in_graph", "gt", 1, base + full + ["--compile.optimizer_in_graph"], group=group,
                            torchrun=False, profile=True))
        else:
            levers = full + ["--compile.optimizer_in_graph", "--training.loss", "fused_linear_ce"]
            runs.append(Run("gt full + optimizer_in_graph + fused loss", "gt", 1, base + levers, group=group, torchrun=False,
                            profile=True))
        if model == "deepseek_v3":
            # eager keeps the unfused intermediates and runs out of memory at step 2 (144.4 GiB asked of 139.8) where
            # Inductor's fused step peaks at 122.9 GiB; expandable segments, to rule out fragmentation, still asked 139.8
            runs.append(Run("gt eager expandable segments", "gt", 1, base + ["--compile.mode", "eager"], group=group,
                            env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, torchrun=False))
        # the memory policy in place of the config's AC (its flags come later and win)
        for budget in c.memory_budgets:
            runs.append(Run(f"gt full + memory_budget {budget}", "gt", 1, base + full + MEMORY_BUDGET + [budget],
                            group=group, torchrun=False, profile=budget == c.profiled_budget))
    return runs


def suite_flex(steps: int) -> list[Run]:
    """FlexAttention with document masks in the traced step against eager (whose FlexAttention torchtitan
    compiles): the debug flavor and the 1B shape with FlexAttention (`1B_flex_attn`), speed without
    determinism, then losses and grad norms of deterministic runs against eager's."""
    def flags(flavor: str, seq: int, batch: int, n: int, deterministic: bool) -> list[str]:
        return ["--model.flavor", flavor, "--training.seq_len", str(seq), "--training.batch_size", str(batch), "--training.steps",
                str(n), "--training.random_tokens", "--metrics.log_freq", "1",
                "--training.deterministic" if deterministic else "--training.no-deterministic"]

    trace = ["--compile.mode", "aot_fx_trace"]
    regional = [*trace, "--compile.inductor_compilation", "regional"]
    full = [*trace, "--compile.inductor_compilation", "full"]
    runs = []
    for group, flavor, seq, batch in (("debug flex", "debugmodel_flex_attn", 2048, 8), ("1B flex", "1B_flex_attn", 4096, 4)):
        speed = flags(flavor, seq, batch, steps, False)
        runs += [_gt("gt eager", group, speed, ["--compile.mode", "eager"]),
                 _gt("gt aot_fx_trace regional", group, speed, regional, profile=True),
                 _gt("gt aot_fx_trace full", group, speed, full, profile=True)]
    # the whole-step levers on top of full Inductor (the scale suite's best configuration)
    runs.append(_gt("gt full + optimizer_in_graph + fused loss", "1B flex", flags("1B_flex_attn", 4096, 4, steps, False),
                    full + ["--compile.optimizer_in_graph", "--training.loss", "fused_linear_ce"], profile=True))
    # Parity: Inductor fuses the attention region's ops (RoPE, casts) that eager runs one by one, so bf16
    # results may differ in the last bits; the bound is 2% relative on losses and grad norms over 8 steps.
    parity = flags("debugmodel_flex_attn", 2048, 8, 8, True)
    group = "debug flex parity"
    runs += [_gt("gt eager deterministic", group, parity, ["--compile.mode", "eager"])]
    for name, extra in (("gt aot_fx_trace regional deterministic", regional), ("gt aot_fx_trace full deterministic", full)):
        run = _gt(name, group, parity, extra, bitwise_with="gt eager deterministic")
        run.bound = 0.02
        runs.append(run)
    return runs


SUITES = {"h100": suite_h100, "h200x2": suite_h200x2, "scale": suite_scale, "flex": suite_flex}


def _steps(run: Run) -> int:
    return int(run.args[run.args.index("--training.steps") + 1])


def _profiling_args(run: Run) -> list[str]:
    if not run.profile:
        return []
    if run.trainer == "gt":
        return ["--profiling.enable", "--profiling.start_step", str(_steps(run) - 1), "--profiling.steps", "1"]
    # torchtitan's schedule: wait, warmup, then the recorded step; the last step is recorded, the one before warms up
    return ["--profiling.enable_profiling", "--profiling.profile_freq", str(_steps(run)), "--profiling.profiler_warmup", "1",
            "--profiling.profiler_active", "1"]


def _command(run: Run, dump: Path) -> list[str]:
    launcher = torchrun(run.nproc) if run.torchrun else [sys.executable]
    if run.trainer == "gt":
        return launcher + ["-m", "graph_trainer", "train", "--job.dump_folder", str(dump), *run.args, *_profiling_args(run)]
    return launcher + ["-m", "torchtitan.train", "--job.dump_folder", str(dump), *run.args, *_profiling_args(run)]


_TITAN_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+|nan|inf).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")
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
    if run.profile:
        # the profiler's warm-up and recorded steps (see _profiling_args) are left out of the throughput
        for r in records:
            r["profiled"] = r["step"] >= _steps(run) - 1
    return records


def _error_lines(output: str) -> str:
    """The rank's own error lines, not torchrun's failure banner."""
    lines = [l for l in output.splitlines() if re.search(r"(Error|error:|Exception)", l) and "elastic" not in l]
    return "\n".join(lines[-6:]) or "\n".join(output.splitlines()[-15:])


def _profile(dump: Path) -> dict:
    # ours, or torchtitan's recorded iteration
    traces = [dump / "profile" / "trace.json", *sorted(dump.glob("profile_traces/iteration_*/rank0_trace.json"))]
    mix = {"kernel_mix": kernel_mix(traces[-1])} if traces[-1].exists() else {}
    path = dump / "profile" / "summary.json"
    if not path.exists():
        return mix
    summary = json.loads(path.read_text())
    return {"exposed_comm_share": summary["exposed_comm_share"], "profiled_step_ms": summary["step_time_ms"],
            "busy_ms": summary["busy_ms"], "kernel_ms": summary["kernel_ms"], "top_kernels": summary["top_kernels"][:8], **mix}


def _prediction(dump: Path) -> dict:
    """The solver's predicted step of an auto-placed run (plan.json beside its metrics)."""
    path = dump / "plan.json"
    if not path.exists():
        return {}
    predicted = json.loads(path.read_text())["predicted"]
    return {"predicted_step_s": predicted["compute_and_optimizer_s"] + predicted["communication_s"]}


def _cost_model_prediction(dump: Path) -> dict:
    """The cost model's prediction the trainer leaves beside its metrics (prediction.json): the step's compute,
    and the communication the REAL job would leave exposed after bucketing and overlap, on the bandwidths named."""
    path = dump / "prediction.json"
    if not path.exists():
        return {}
    p = json.loads(path.read_text())
    return {"predicted_compute_ms": p["compute_ms"], "predicted_exposed_comm_ms": p["exposed_comm_ms"],
            "predicted_real_step_ms": p["step_ms"], "prediction_hardware": p.get("hardware"), "prediction_bandwidths": p.get("bandwidths")}


def summarize(run: Run, records: list[dict], wall_s: float, rc: int, tail: str) -> dict:
    steady = [r for r in records if r["step"] > WARMUP_STEPS and not r.get("profiled")]
    out = {"name": run.name, "group": run.group, "trainer": run.trainer, "nproc": run.nproc, "args": run.args,
           "returncode": rc, "wall_s": round(wall_s, 1), "steps": len(records),
           "losses": [r["loss"] for r in records], "grad_norms": [r.get("grad_norm") for r in records]}
    if not steady:
        # a run cut short in its warm-up has no throughput to report: its first steps include compilation
        out["error"] = f"{len(records)} steps, none after the {WARMUP_STEPS}-step warm-up: {tail}" if records else tail
        return out
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    out.update(
        tokens_per_second=statistics.median(r["tokens_per_second"] for r in steady),
        mfu=statistics.median(mfus) if mfus else None,
        peak_memory_gib=max(r["peak_memory_gib"] for r in records),
        step_time_s=statistics.median(r["step_time_s"] for r in steady) if all("step_time_s" in r for r in steady) else None,
        time_to_first_step_s=records[0].get("time_to_first_step_s"),
    )
    # the memory policy's choice (saved / recomputed / offloaded activations), where one ran, and the first step's
    # time by phase and graph pass
    out.update({k: v for k, v in records[0].items() if k.startswith(("ac_", "pass_")) or k in ("trace_s", "compile_s")})
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
            partial = "".join(s.decode(errors="replace") if isinstance(s, bytes) else s for s in (e.stdout or "", e.stderr or ""))
            rc, output = -9, f"timed out after {timeout}s\n{partial}"
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "log.txt").write_text(output)
        result = summarize(run, _records(run, dump, output), time.perf_counter() - start, rc, _error_lines(output))
        result.update(_profile(dump), **_prediction(dump), **_cost_model_prediction(dump), env=run.env)
        if run.bitwise_with:
            ref = next((r for r in results if r["name"] == run.bitwise_with and r["group"] == run.group), None)
            result["bitwise_with"] = run.bitwise_with
            result["bitwise_equal"] = bool(ref and ref["losses"] and (ref["losses"], ref.get("grad_norms")) == (result["losses"], result["grad_norms"]))
            if ref and ref["losses"] and len(ref["losses"]) == len(result["losses"]):
                pairs = list(zip(ref["losses"] + ref["grad_norms"], result["losses"] + result["grad_norms"]))
                result["max_rel_diff"] = max(abs(a - b) / max(abs(a), 1e-12) for a, b in pairs)
                if run.bound:
                    result["bound"] = run.bound
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "args")}), flush=True)
        report(add_ratios(results))
    return add_ratios(results)


def add_ratios(results: list[dict]) -> list[dict]:
    for r in results:
        base = next((b for b in results if b["group"] == r["group"] and b["name"] == "titan eager" and b.get("tokens_per_second")), None)
        if base and r.get("tokens_per_second"):
            r["ratio_to_titan_eager"] = r["tokens_per_second"] / base["tokens_per_second"]
        compiled = next((b for b in results if b["group"] == r["group"] and b["name"] == "titan compile" and b.get("tokens_per_second")), None)
        if compiled and r.get("tokens_per_second"):
            r["ratio_to_titan_compile"] = r["tokens_per_second"] / compiled["tokens_per_second"]
    return results


def write_report(results: list[dict], suite: str, out: Path, device: str, commands: list[str]) -> Path:
    stem = out / f"{datetime.date.today().isoformat()}-{suite}"
    stem.with_suffix(".json").write_text(json.dumps({"suite": suite, "device": device, "commands": commands,
                                                     "results": results}, indent=2) + "\n")
    lines = [f"# {suite} on {device}", "", "Made by:", "", *[f"    {c}" for c in commands], "",
             "| group | run | tokens/s/GPU | MFU % | peak mem GiB | first step s | exposed comm % | vs titan eager | vs titan compile | bitwise | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        def fmt(key, spec, scale=1.0):
            return format(r[key] * scale, spec) if r.get(key) is not None else "-"
        bitwise = "-" if "bitwise_equal" not in r else ("yes" if r["bitwise_equal"] else f"NO (vs {r['bitwise_with']})")
        if "bound" in r and not r["bitwise_equal"]:
            verdict = "within" if r["max_rel_diff"] <= r["bound"] else "OUTSIDE"
            bitwise = f"no; max rel diff {r['max_rel_diff']:.1e}, {verdict} the {r['bound']:g} bound"
        cause = [line for line in r.get("error", "").splitlines() if "ChildFailedError" not in line and "lspci" not in line]
        status = "ok" if r.get("tokens_per_second") else "failed: " + (cause or [""])[-1][:100].replace("|", "/")
        if status == "ok" and any(math.isnan(x) for x in r.get("losses", [])):
            # NaN operands run GEMMs at higher clocks (bench/fake_data_check.py): not comparable with a finite run
            status = "ok, losses NaN: speed inflated"
        lines.append(f"| {r['group']} | {r['name']} | {fmt('tokens_per_second', ',.0f')} | {fmt('mfu', '.1f')} | "
                     f"{fmt('peak_memory_gib', '.1f')} | {fmt('time_to_first_step_s', '.0f')} | {fmt('exposed_comm_share', '.1f', 100)} | "
                     f"{fmt('ratio_to_titan_eager', '.2f')} | {fmt('ratio_to_titan_compile', '.2f')} | {bitwise} | {status} |")
    predicted = [r for r in results if r.get("predicted_step_s") and r.get("step_time_s")]
    if predicted:
        lines += ["", "Auto-placed runs: the solver's predicted step (compute + optimizer + serial communication, "
                      "plan.json) against the measured median step:", "",
                  "| run | predicted ms | measured ms | predicted / measured |", "|---|---|---|---|"]
        lines += [f"| {r['name']} | {1e3 * r['predicted_step_s']:.1f} | {1e3 * r['step_time_s']:.1f} | "
                  f"{r['predicted_step_s'] / r['step_time_s']:.2f} |" for r in predicted]
    projected = [r for r in results if r.get("predicted_compute_ms") is not None and r.get("step_time_s")]
    if projected:
        lines += ["", "Fake-communication runs measure one rank's compute; the cost model (prediction.json) adds the communication "
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
    for r in results:
        # profiles recorded before kernel-time shares existed gave shares of the profiler-slowed wall time
        if not r.get("top_kernels") or "kernel_ms" not in r:
            continue
        lines += ["", f"Top kernels of one profiled step, {r['group']}: {r['name']} ({r['profiled_step_ms']:.1f} ms, "
                      f"kernels busy {r['busy_ms']:.1f} ms, kernel time {r['kernel_ms']:.1f} ms):", "",
                  "| kernel | calls | ms | share of kernel time |", "|---|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['count']} | {k['ms_per_step']:.2f} | {100 * k['share_of_kernel_time']:.1f}% |" for k in r["top_kernels"]]
    lines += _kernel_mix_tables(results)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(results, stem)
    return stem


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
    parser.add_argument("--only", default="", help="comma-separated run names, run in this order (default: all)")
    parser.add_argument("--groups", default="", help="comma-separated run groups (default: all)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per run")
    parser.add_argument("--runs-dir", default="", help="where the runs' dump folders go (default: a temporary folder)")
    parser.add_argument("--merge", nargs="*", default=[],
                        help="JSON results of earlier calls to put in front of this one's; without --only/--groups, only merge")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: graph-trainer runs on the debug model, fp32")
    a = parser.parse_args()
    runs = SUITES[a.suite](a.steps)
    if a.only:
        # in the order given: a call that may run out of time runs what matters most first
        order = a.only.split(",")
        runs = sorted((r for r in runs if r.name in order), key=lambda r: order.index(r.name))
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
    batch = "4"
    if "--comm.fake_world_size" in args:
        # one sequence per data-parallel rank of the simulated job
        tp = int(args[args.index("--parallelism.tp") + 1]) if "--parallelism.tp" in args else 1
        batch = str(int(args[args.index("--comm.fake_world_size") + 1]) // tp)
    for flag, value in (("--model.flavor", "debugmodel"), ("--training.seq_len", "64"), ("--training.batch_size", batch),
                        ("--training.steps", "5")):
        if flag in args:
            args[args.index(flag) + 1] = value
    if "cudagraph" in args:
        i = args.index("cudagraph")
        del args[i - 1 : i + 1]
    return Run(run.name, run.trainer, run.nproc, args + ["--training.mixed_precision_param", "float32"], run.bitwise_with,
               run.group, run.env, run.profile, run.torchrun)


if __name__ == "__main__":
    raise SystemExit(main())
