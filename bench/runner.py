"""Running a suite's runs one after another: the command of each (launcher, profiling flags, the weights it starts
from), launching it with a timeout that ends its whole process tree, reading back what it left (metrics, torchtitan's
log lines and active memory, profiles, the solver's and the cost model's predictions, NCCL's protocols), and checking
it against its reference run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

from graph_trainer.compare import torchrun
from graph_trainer.metrics import read_metrics
from kernel_mix import device_events, exposed_comm, kernel_mix
from logs import ANSI, FIRST_STEP, error_lines, nccl_protocols, titan_records
from runs import REPO, WARMUP_STEPS, Run, last_measured_step, steps_of

TITAN_MEMORY = "titan_memory.jsonl"
"""Written by bench/titan_spec.py into torchtitan's dump folder: rank 0's peak active and reserved bytes per step."""


def dump_folder(runs_dir: Path, group: str, name: str) -> Path:
    return runs_dir / re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{group}-{name}")


def _profiling_args(run: Run) -> list[str]:
    """Both trainers record the last step, the profiler started a step before it (a warm-up step it drops)."""
    if not run.profile:
        return []
    if run.trainer == "gt":
        return ["--profiling.enable", "--profiling.start_step", str(steps_of(run)), "--profiling.steps", "1"]
    # torchtitan's schedule: wait, warmup, then the recorded step
    return ["--profiling.enable_profiling", "--profiling.profile_freq", str(steps_of(run)), "--profiling.profiler_warmup", "1",
            "--profiling.profiler_active", "1"]


def hf_export(runs_dir: Path, run: Run) -> Path:
    """The Hugging Face folder the run named by `run.start_from` wrote (--checkpoint.last_save_in_hf: step-<last>-hf)."""
    root = dump_folder(runs_dir, run.group, run.start_from) / "checkpoint"
    found = sorted(root.glob("step-*-hf"))
    return found[-1] if found else root / "step-*-hf"


def _start_from_args(run: Run, runs_dir: Path) -> list[str]:
    if not run.start_from:
        return []
    weights = ["--checkpoint.initial_load_path", str(hf_export(runs_dir, run)), "--checkpoint.initial_load_in_hf"]
    # torchtitan reads initial weights only with checkpointing on; load_only keeps it from saving any
    return weights if run.trainer == "gt" else ["--checkpoint.enable", "--checkpoint.load_only", *weights]


def _warm_from_args(run: Run, runs_dir: Path) -> list[str]:
    if not run.warm_from:
        return []
    return ["--compile.cache_dir", str(dump_folder(runs_dir, run.group, run.warm_from) / "compile_cache")]


def command(run: Run, runs_dir: Path) -> list[str]:
    dump = dump_folder(runs_dir, run.group, run.name)
    launcher = torchrun(run.nproc) if run.torchrun else [sys.executable]
    if run.torchrun and run.trainer == "titan":
        # every torchtitan rank logs its steps: each line tagged with its rank, so rank 0's are the ones read
        launcher += ["--role", "rank", "--tee", "3"]
    module = ["-m", "graph_trainer", "train"] if run.trainer == "gt" else ["-m", "torchtitan.train"]
    return launcher + module + ["--job.dump_folder", str(dump), *run.args, *_profiling_args(run), *_start_from_args(run, runs_dir),
                                    *_warm_from_args(run, runs_dir)]


def _process_tree(pid: int) -> list[int]:
    """`pid` and every live process below it, from /proc."""
    children = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children[ppid].append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def kill_tree(pid: int) -> None:
    """Kill `pid` and everything below it. torchrun starts each rank in a session of its own, out of reach of its
    process group, and a rank left running holds its GPU: the tree is frozen first (no process starts another while
    it is being walked), then killed."""
    stopped: set[int] = set()
    while new := [p for p in _process_tree(pid) if p not in stopped]:
        for p in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
            stopped.add(p)
    for p in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def launch(cmd: list[str], env: dict, timeout: int) -> tuple[int, str, float | None]:
    """Run to the end or the timeout (which kills every process of the run, torchrun's ranks too); returns the exit
    code (-9 on timeout), the output (stdout and stderr interleaved) and the seconds from launch to the line of step 1."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env)
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        kill_tree(proc.pid)

    timer = threading.Timer(timeout, kill)
    timer.start()
    lines, first_step = [], None
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if first_step is None and FIRST_STEP.search(ANSI.sub("", line)):
            first_step = time.perf_counter() - start
    rc = proc.wait()
    timer.cancel()
    output = "".join(lines)
    if expired.is_set():
        return -9, f"timed out after {timeout}s\n{output}", first_step
    return rc, output, first_step


def records(run: Run, dump: Path, output: str) -> list[dict]:
    if run.trainer == "gt":
        return read_metrics(dump)
    found = titan_records(output)
    memory_path = dump / TITAN_MEMORY
    memory = {}
    if memory_path.exists():
        memory = {m["step"]: m for m in map(json.loads, memory_path.read_text().splitlines())}
    for r in found:
        # like for like with ours: the allocator's peak active bytes (reserved bytes vary between identical runs)
        r["peak_memory_gib"] = memory.get(r["step"], {}).get("active_peak_gib")
    return found


def summarize(run: Run, found: list[dict], wall_s: float, rc: int, tail: str) -> dict:
    # the profiler's warm-up and recorded steps (see _profiling_args) are left out of the throughput
    steady = [r for r in found if WARMUP_STEPS < r["step"] <= last_measured_step(run)]
    out = {"name": run.name, "group": run.group, "trainer": run.trainer, "nproc": run.nproc, "args": run.args,
           "returncode": rc, "wall_s": round(wall_s, 1), "steps": len(found),
           "losses": [r["loss"] for r in found], "grad_norms": [r.get("grad_norm") for r in found]}
    if any("dropped_tokens" in r for r in found):
        # MoE pairs past the capacity, per step: what a capacity factor cost, beside its speed
        out["dropped_tokens"] = [r.get("dropped_tokens") for r in found]
    if not steady:
        # a run cut short in its warm-up has no throughput to report: its first steps include compilation
        out["error"] = f"{len(found)} steps, none after the {WARMUP_STEPS}-step warm-up: {tail}" if found else tail
        return out
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    memory = [r["peak_memory_gib"] for r in found if r.get("peak_memory_gib") is not None]
    reserved = [r["reserved_memory_gib"] for r in found if r.get("reserved_memory_gib") is not None]
    out.update(
        tokens_per_second=statistics.median(r["tokens_per_second"] for r in steady),
        mfu=statistics.median(mfus) if mfus else None,
        peak_memory_gib=max(memory) if memory else None,
        step_time_s=statistics.median(r["step_time_s"] for r in steady) if all("step_time_s" in r for r in steady) else None,
        time_to_first_step_s=found[0].get("time_to_first_step_s"),
    )
    if reserved:
        out["reserved_memory_gib"] = max(reserved)
    # the memory policy's choice (saved / recomputed / offloaded activations), where one ran, and the first step's
    # time by phase and graph pass
    out.update({k: v for k, v in found[0].items() if k.startswith(("ac_", "pass_", "compile_cache", "compile_workers"))
                or k in ("trace_s", "trace_cache", "step_cache", "trace_store_s", "compile_s", "compiled_blocks", "block_pieces", "layers", "decomposed_pieces",
                         "worker_compiled_pieces", "traced_blocks", "before_init_s", "init_s", "first_call_s", "optimizer_s", "pp_stage_layers")})
    return out


def profile(dump: Path) -> dict:
    """Ours (profile/summary.json and trace.json) or torchtitan's recorded iteration: kernel time by kind and the
    exposed communication read from the trace, the same way for both trainers."""
    traces = [dump / "profile" / "trace.json", *sorted(dump.glob("profile_traces/iteration_*/rank0_trace.json"))]
    out = {}
    if traces[-1].exists():
        events = device_events(traces[-1])
        out["kernel_mix"] = kernel_mix(events)
        out.update({f"trace_{k}": v for k, v in exposed_comm(events).items()})
    path = dump / "profile" / "summary.json"
    if path.exists():
        summary = json.loads(path.read_text())
        out.update(exposed_comm_share=summary["exposed_comm_share"], profiled_step_ms=summary["step_time_ms"],
                   busy_ms=summary["busy_ms"], kernel_ms=summary["kernel_ms"], top_kernels=summary["top_kernels"][:8])
    return out


def solver_prediction(dump: Path) -> dict:
    """The solver's predicted step of an auto-placed run (plan.json beside its metrics)."""
    path = dump / "plan.json"
    if not path.exists():
        return {}
    plan = json.loads(path.read_text())
    if "stages" in plan:
        # a pipeline's stages overlap under the schedule: no one step to read off their plans
        return {}
    predicted = plan["predicted"]
    return {"predicted_step_s": predicted["compute_and_optimizer_s"] + predicted["communication_s"]}


def cost_model_prediction(dump: Path) -> dict:
    """The cost model's prediction the trainer leaves beside its metrics (prediction.json): the step's compute,
    and the communication the REAL job would leave exposed after bucketing and overlap, on the bandwidths named."""
    path = dump / "prediction.json"
    if not path.exists():
        return {}
    p = json.loads(path.read_text())
    return {"predicted_compute_ms": p["compute_ms"], "predicted_exposed_comm_ms": p["exposed_comm_ms"],
            "predicted_exposed_by_kind_ms": p.get("exposed_comm_ms_by_kind", {}),
            "predicted_real_step_ms": p["step_ms"], "prediction_hardware": p.get("hardware"), "prediction_bandwidths": p.get("bandwidths")}


def against_reference(run: Run, result: dict, results: list[dict]) -> dict:
    """Losses (and grad norms) against the run named by `bitwise_with` in the same group: bitwise equal, or the
    differences `bound` / `loss_bound` limit."""
    ref = next((r for r in results if r["name"] == run.bitwise_with and r["group"] == run.group), None)
    out: dict = {"bitwise_with": run.bitwise_with}
    if ref is None:
        # not run in this call nor merged (a CPU dry run has no torchtitan runs): nothing to judge
        return {**out, "reference_missing": True}
    out["bitwise_equal"] = bool(ref["losses"] and (ref["losses"], ref.get("grad_norms")) == (result["losses"], result["grad_norms"]))
    if not (ref["losses"] and len(ref["losses"]) == len(result["losses"])):
        return out
    pairs = list(zip(ref["losses"] + ref["grad_norms"], result["losses"] + result["grad_norms"]))
    out["max_rel_diff"] = max((abs(a - b) / max(abs(a), 1e-12) for a, b in pairs if a is not None and b is not None), default=0.0)
    if run.bound:
        out["bound"] = run.bound
    if run.loss_bound:
        diffs = [abs(a - b) for a, b in zip(ref["losses"], result["losses"])]
        out.update(loss_bound=list(run.loss_bound), mean_abs_loss_diff=statistics.fmean(diffs), max_abs_loss_diff=max(diffs),
                   first_step_abs_loss_diff=diffs[0])
        out["within_loss_bound"] = out["mean_abs_loss_diff"] <= run.loss_bound[0] and out["max_abs_loss_diff"] <= run.loss_bound[1]
    return out


IMPORTS = "import torchtitan.train, bench.titan_spec, graph_trainer.trainer, graph_trainer.passes.compile_worker_process"
"""What both trainers import (ours, its compile workers too)."""

KERNEL_LIBRARIES = """
import torch, torch.nn.functional as F
if torch.cuda.is_available():
    q = torch.randn(1, 8, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    (q.view(-1, 128) @ q.view(-1, 128).t()).sum().backward()
    torch.cuda.synchronize()
"""
"""A step's kinds of GPU kernels (attention, matmuls, forward and backward): their libraries load them on first use."""


def warm_imports() -> None:
    """Import both trainers once before the first timed run, and call the GPU's kernel libraries: the first process
    of a device call reads torch's libraries from disk and compiles the bytecode of the wheels installed for the call
    (one H200: 15.3 s for the imports of our trainer, 11.6 s when run again), and the first to run attention and
    matmuls on the GPU loads their kernels (one H200: an op of our first step's first call took about 2 s more in the
    call's first run than in its later ones, bench/results/2026-11-29-session19); a cost that would fall on whichever
    trainer runs first."""
    subprocess.run([sys.executable, "-c", f"{IMPORTS}\n{KERNEL_LIBRARIES}"], cwd=REPO, capture_output=True, check=False)


def launch_cold(run: Run, runs_dir: Path, timeout: int, flags: Sequence[str] = (), env: dict | None = None,
                prefix: Sequence[str] = ()) -> tuple[Path, int, str, float | None]:
    """Launch `run` (its command with `flags` added, under `prefix`, e.g. a sampling profiler, with `env` over its own)
    as a cold start, and leave its output in `<dump>/log.txt`: its dump folder, exit code, output and seconds from
    launch to step 1. Every run compiles cold: Inductor's and Triton's caches of an earlier run would shorten its time
    to step 1, and so would the folder of the same run in an earlier call on a machine kept warm (its compile cache)."""
    dump = dump_folder(runs_dir, run.group, run.name)
    shutil.rmtree(dump, ignore_errors=True)
    cold = {"TORCHINDUCTOR_CACHE_DIR": str(dump / "inductor_cache"), "TRITON_CACHE_DIR": str(dump / "triton_cache")}
    rc, output, first_step = launch([*prefix, *command(run, runs_dir), *flags], {**os.environ, **cold, **run.env, **(env or {})},
                                    timeout)
    dump.mkdir(parents=True, exist_ok=True)
    (dump / "log.txt").write_text(output)
    return dump, rc, output, first_step


START_KEYS = ("before_init_s", "init_s", "trace_s", "compile_s", "compile_workers_ready_s", "compile_workers_first_piece_s",
              "compile_workers_s", "first_call_s", "step_estimate_train_step_s")
"""Our step-1 record's start-up figures that a cold-start comparison keeps (docs/metrics-and-profiling.md)."""


def cold_rounds(configs: dict[str, tuple[Run, dict]], rounds: int, runs_dir: Path, out: Path, timeout: int) -> list[dict]:
    """Cold starts (`launch_cold`) of each config, a run and the environment over its own, in `rounds` rounds, each
    starting one config later than the one before, so that no config always runs first or after the same one. Each
    run's row (launch to step 1, tokens/s of every step, `START_KEYS`) is printed and `<out>/rows.json` rewritten as
    it ends, so a call cut short keeps what ran; the logs end in `<out>/logs.tgz`."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(runs_dir / "pycache")
    warm_imports()
    names, rows = list(configs), []
    for rnd in range(rounds):
        for name in names[rnd % len(names):] + names[: rnd % len(names)]:
            run, env = configs[name]
            dump, rc, output, first = launch_cold(run, runs_dir, timeout, env=env)
            recs = records(run, dump, output)
            rec = recs[0] if recs else {}
            row = {"round": rnd + 1, "config": name, "rc": rc, "launch_to_step1_s": first,
                   "tokens_per_second": [round(r.get("tokens_per_second") or 0) for r in recs],
                   **{k: rec[k] for k in START_KEYS if k in rec}}
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / f"r{rnd + 1}-{re.sub(r'[^A-Za-z0-9]+', '', name)}.log").write_text(output)
            (out / "rows.json").write_text(json.dumps(rows, indent=1))
    with contextlib.suppress(subprocess.CalledProcessError):
        logs = sorted(p.name for p in out.glob("r*.log"))
        subprocess.run(["tar", "czf", "logs.tgz", *logs], cwd=out, check=True)
        for name in logs:
            (out / name).unlink()
    return rows


def run_suite(runs: list[Run], runs_dir: Path, timeout: int, earlier: list[dict], on_result: Callable[[list[dict]], None]) -> list[dict]:
    """Run each in turn; `on_result` gets all results after every run, so a call cut short keeps what ran."""
    results: list[dict] = list(earlier)
    warm_imports()
    for run in runs:
        print(f"== {run.group}: {run.name}", flush=True)
        start = time.perf_counter()
        dump, rc, output, first_step = launch_cold(run, runs_dir, timeout)
        result = summarize(run, records(run, dump, output), time.perf_counter() - start, rc, error_lines(output))
        result.update(profile(dump), **solver_prediction(dump), **cost_model_prediction(dump), env=run.env)
        result["launch_to_first_step_s"] = first_step
        protocols = nccl_protocols(output)
        if protocols:
            result["nccl_protocols"] = protocols
        if run.bitwise_with:
            result.update(against_reference(run, result, results))
        # a run measured again replaces its earlier result
        results = [r for r in results if (r["group"], r["name"]) != (run.group, run.name)] + [result]
        print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "grad_norms", "args", "nccl_protocols")}), flush=True)
        on_result(results)
    return results
