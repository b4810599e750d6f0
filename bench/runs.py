"""What one benchmark run is: a trainer (graph-trainer "gt" or torchtitan 0.2.2 "titan"), its flags and ranks, and
what the runner checks it against; the constructors the suites build runs with; and the CPU dry run's shrinking of a
run (`tiny`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 3
"""Steps left out of the throughput median: their first steps include compilation."""


@dataclass
class Run:
    name: str
    trainer: str  # "gt" or "titan"
    nproc: int
    args: list[str]
    bitwise_with: str = ""
    """Name of an earlier run of the group whose losses this one must equal bit for bit (or within `bound` /
    `loss_bound`)."""
    group: str = ""
    env: dict = field(default_factory=dict)
    profile: bool = False
    """Profile one steady step: graph-trainer's --profiling (exposed communication, top kernels), torchtitan's
    profiler on its last step; both give the step's kernel time by kind and exposed communication (`kernel_mix`)."""
    torchrun: bool = True
    """False: one plain process (a fake-communication run of one rank of a larger job)."""
    bound: float = 0.0
    """With `bitwise_with`: where the kernels differ (Inductor fuses what eager runs op by op), the largest
    relative difference of losses and grad norms allowed; 0 asks for bitwise equality."""
    loss_bound: tuple[float, ...] = ()
    """With `bitwise_with`: (mean, max) of |loss difference| over the whole curve allowed, for bf16 runs of two
    trainers whose kernels and reduction orders differ from step 1 on."""
    start_from: str = ""
    """Name of an earlier run of the group that wrote a Hugging Face checkpoint (--checkpoint.last_save_in_hf):
    this run starts from those weights."""
    warm_from: str = ""
    """Name of an earlier graph-trainer run of the group: this run is that job started again, loading the compiled step
    from that run's compile cache (`--compile.cache_dir`) with Inductor's and Triton's own caches empty, as a restart
    on another node would."""


def steps_of(run: Run) -> int:
    return int(run.args[run.args.index("--training.steps") + 1])


def last_measured_step(run: Run) -> int:
    """The last step whose time counts in the throughput (after the `WARMUP_STEPS`): a profiled run's last two steps,
    the profiler's warm-up and its recorded step, do not."""
    return steps_of(run) - 2 * run.profile


def gt(name: str, group: str, base: list[str], extra: list[str], nproc: int = 1, bitwise_with: str = "",
       env: dict | None = None, profile: bool = False) -> Run:
    return Run(name, "gt", nproc, base + extra, bitwise_with, group, env or {}, profile)


def titan(name: str, group: str, flavor: str, batch: int, seq: int, steps: int, nproc: int, extra: list[str],
          model: str = "gt_llama3", profile: bool = False) -> Run:
    """torchtitan's own trainer through bench/titan_spec.py (our flavors and random tokens); `batch` is per rank."""
    # a profiled run's last two steps (profiler warm-up, recorded step) are not measured: two more steps
    args = ["--model.name", model, "--model.flavor", flavor, "--training.local_batch_size", str(batch),
            "--training.seq_len", str(seq), "--training.steps", str(steps + 2 * profile), "--metrics.log_freq", "1",
            "--model.hf_assets_path", str(REPO / "graph_trainer/data/assets"), "--experimental.custom_import",
            "bench.titan_spec", "--activation_checkpoint.mode", "none", *extra]
    return Run(name, "titan", nproc, args, group=group, profile=profile)


def production_config(model: str, flavor: str) -> list[str]:
    """The flags that load the model's production config as shipped (`configs/<model>_<flavor>.toml`, relative to the
    repository the runs start in); none where the model has no such config."""
    path = REPO / "configs" / f"{model}_{flavor.lower()}.toml"
    return ["--config", str(path.relative_to(REPO))] if path.exists() else []


TRACE = ["--compile.mode", "aot_fx_trace"]
FX = [*TRACE, "--compile.inductor_compilation", "none"]
"""The traced step run by FX op by op: bitwise comparable with eager (the GPU default backend is full Inductor)."""
FULL = [*TRACE, "--compile.inductor_compilation", "full"]
META_PLACED = ["--compile.autoparallel", "--compile.autoparallel_impl", "meta"]
MEMORY_BUDGET = ["--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget"]
"""Followed by the budget, e.g. "36GiB"."""


def tiny(run: Run) -> Run:
    """The run shrunk for a CPU dry run: debug model, 64 tokens, 6 steps (one measured between the warm-up and the
    profiler's two), fp32 (bf16 storage too); CUDA-only passes dropped."""
    args = list(run.args)
    batch = "4"
    if "--comm.fake_world_size" in args:
        # one sequence per data-parallel rank of the simulated job
        tp = int(args[args.index("--parallelism.tp") + 1]) if "--parallelism.tp" in args else 1
        batch = str(int(args[args.index("--comm.fake_world_size") + 1]) // tp)
    for flag, value in (("--model.flavor", "debugmodel"), ("--training.seq_len", "64"), ("--training.batch_size", batch),
                        ("--training.steps", "6")):
        # a pipeline's batch is its microbatches
        if flag in args and not (flag == "--training.batch_size" and "--parallelism.pp_microbatches" in args):
            args[args.index(flag) + 1] = value
    if "cudagraph" in args:
        i = args.index("cudagraph")
        del args[i - 1 : i + 1]
    if "--training.dtype" in args:
        i = args.index("--training.dtype")
        del args[i : i + 2]
    return replace(run, args=args + ["--training.mixed_precision_param", "float32"])
