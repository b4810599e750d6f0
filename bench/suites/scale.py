"""The `scale` suite: one rank of an N-rank job on one GPU with fake communication, torchtitan beside graph-trainer."""

from __future__ import annotations

from dataclasses import dataclass, replace

from runs import MEMORY_BUDGET, WARMUP_STEPS, Run, production_config, titan


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


# the four configs, and 70B cut to 8 layers to profile where its step goes
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


def suite_scale(steps: int, gpus: int) -> list[Run]:
    """One rank of an N-rank job on one GPU: torchtitan under `--comm.mode fake_backend` (NGPU=N, rank 0, no
    torchrun) beside graph-trainer under `--comm.mode fake`. Each group fits one 10-minute device call."""
    runs = []
    for c in SCALE_CONFIGS:
        group, ranks, model, flavor, local_batch, seq, gt_mesh, ac = c.group, c.ranks, c.model, c.flavor, c.local_batch, c.seq, c.gt_mesh, c.ac
        # at least one step measured between the warm-up and a profiled run's last two (profiler warm-up, recorded step)
        n = max(WARMUP_STEPS + 3, round(steps * c.step_scale * 8 / 12))
        dp = ranks // 2 if "--parallelism.tp" in gt_mesh else ranks
        ac_flags = ["--activation_checkpoint.mode", ac] + (["--activation_checkpoint.selective_ac_option", "2"] if ac == "selective" else [])
        job = ["--model.name", model, "--model.flavor", flavor, "--training.seq_len", str(seq), "--training.batch_size",
               str(dp * local_batch), "--training.steps", str(n), "--training.random_tokens", "--training.no-deterministic",
               "--metrics.log_freq", "1", "--comm.mode", "fake", "--comm.fake_world_size", str(ranks), *gt_mesh,
               *(["--model.n_layers", str(c.layers)] if c.layers else [])]
        base = job + ac_flags
        titan_model = "gt_deepseek_v3" if model == "deepseek_v3" else "gt_llama3"
        titan_flags = ["--comm.mode", "fake_backend", *c.titan_mesh, *ac_flags]
        fake_env = {"NGPU": str(ranks), "LOCAL_RANK": "0", "RANK": "0"}

        def titan_run(name: str, extra: list[str], titan_model: str = titan_model, profile: bool = False) -> Run:
            titan_flavor = f"{flavor}-{c.layers}L" if c.layers else flavor
            run = titan(name, group, titan_flavor, local_batch, seq, n, 1, titan_flags + extra, model=titan_model, profile=profile)
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
        # the same job started again, on the compile cache the cold run filled; and the in-graph optimizer
        # alone, whose cold compile is held to at most 1.2x the full compile's
        runs.append(replace(Run("gt full restart", "gt", 1, base + full, group=group, torchrun=False), warm_from="gt aot_fx_trace full"))
        # the cold compile without compile workers (passes/compile_workers.py): every piece compiled by the rank itself
        runs.append(Run("gt full no compile workers", "gt", 1, base + full + ["--compile.compile_workers", "0"], group=group,
                        torchrun=False))
        runs.append(Run("gt full + optimizer_in_graph", "gt", 1, base + full + ["--compile.optimizer_in_graph"], group=group,
                        torchrun=False, profile="--parallelism.tp" in gt_mesh))
        # our best configuration on every config, profiled (the report's top kernels say where its time goes)
        # (the fused loss needs the whole vocabulary on the rank: not under TP)
        if "--parallelism.tp" not in gt_mesh:
            levers = full + ["--compile.optimizer_in_graph", "--training.loss", "fused_linear_ce"]
            runs.append(Run("gt full + optimizer_in_graph + fused loss", "gt", 1, base + levers, group=group, torchrun=False,
                            profile=True))
        if model == "deepseek_v3":
            # eager keeps the unfused intermediates and runs out of memory at step 2 (144.4 GiB asked of 139.8) where
            # Inductor's fused step peaks at 122.9 GiB; expandable segments, to rule out fragmentation, still asked 139.8
            runs.append(Run("gt eager expandable segments", "gt", 1, base + ["--compile.mode", "eager"], group=group,
                            env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, torchrun=False))
        # the model's production config as shipped (its activation checkpointing, the in-graph optimizer) on this job's
        # model, mesh and tokens: what a user of it runs
        production = production_config(model, flavor)
        if production and not c.layers:
            runs.append(Run("gt production config", "gt", 1, job + production, group=group, torchrun=False))
        # the memory policy in place of the config's AC (its flags come later and win)
        for budget in c.memory_budgets:
            runs.append(Run(f"gt full + memory_budget {budget}", "gt", 1, base + full + MEMORY_BUDGET + [budget],
                            group=group, torchrun=False, profile=budget == c.profiled_budget))
    return runs


