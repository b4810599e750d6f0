"""Suites of several GPUs of one host, real NCCL, every rank its own process under torchrun: `multi` (torchtitan 0.2.2
and graph-trainer side by side on all GPUs of the machine), `numerics` (the same weights and tokens in both trainers;
deterministic traced steps against eager, bit for bit) and the older `h200x2`.

`multi` splits each config into two groups, each one device call (< 10 minutes) with its own torchtitan compile, so
every ratio pairs runs of the same call: `<config>` (torchtitan eager and compile, ours eager and the best manual
configuration, both sides profiled) and `<config> auto` (torchtitan compile, auto-placed with full Inductor, profiled,
and with `autoparallel_backend`); auto-placed against our best manual is their ratios to torchtitan compile, each of
its own call (an 8B's third cold compile would push the second call past 10 minutes). Our `--training.batch_size` is global: the per-rank batch times the
data-parallel degree; torchtitan's `--training.local_batch_size` is the per-rank batch."""

from __future__ import annotations

from dataclasses import dataclass, replace

from runs import FULL, FX, TRACE, Run, gt, production_config, titan

FUSED_LOSS = ["--training.loss", "fused_linear_ce"]
IN_GRAPH_OPTIMIZER = ["--compile.optimizer_in_graph"]

# NCCL prints, per collective, the algorithm and protocol it chose (rank 0 of each communicator); bench/logs.py
# reads them from the output
NCCL_TUNING_LOG = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "TUNING"}


@dataclass
class MultiConfig:
    group: str
    model: str
    flavor: str
    layers: int
    """Cut the flavor to this many layers (0: all); torchtitan's flavor `<flavor>-<layers>L` (bench/titan_spec.py)."""
    local_batch: int
    """Sequences per data-parallel rank."""
    seq: int
    dp_shard: int
    tp: int = 1
    ep: int = 1
    ac: str = "none"
    pp: int = 1
    schedule: str = ""
    """The pipeline schedule, with pp > 1; a data-parallel rank's `local_batch` sequences are its microbatches."""
    memory_budgets: tuple[str, ...] = ()
    """Runs of the memory policy (`--activation_checkpoint.mode memory_budget`) in place of `ac`: at torchtitan
    compile's measured peak active memory for the config, our recomputation chosen to fit where it keeps its."""

    def gt_flags(self) -> list[str]:
        mesh = ["--parallelism.dp_shard", str(self.dp_shard), "--parallelism.tp", str(self.tp)]
        if self.pp > 1:
            mesh += ["--parallelism.pp", str(self.pp), "--parallelism.pp_schedule", self.schedule, "--parallelism.pp_microbatches",
                     str(self.local_batch)]
        mesh += ["--parallelism.ep", str(self.ep)] if self.ep > 1 else []
        return mesh + self.dtype_flags

    @property
    def dtype_flags(self) -> list[str]:
        """torchtitan has no mixed precision for TP or PP without FSDP ("only supported when FSDP/HSDP/CP is enabled"):
        it trains such a mesh in fp32 (4.2% MFU at 8B-16L tp 2 on 2 H200s, bench/results/2026-11-29-session20), or in
        bf16 throughout with --training.dtype bfloat16; both trainers run that."""
        return ["--training.dtype", "bfloat16"] if self.dp_shard == 1 and (self.tp > 1 or self.pp > 1) else []

    def titan_flags(self) -> list[str]:
        mesh = ["--parallelism.data_parallel_shard_degree", str(self.dp_shard), "--parallelism.tensor_parallel_degree", str(self.tp)]
        if self.pp > 1:
            mesh += ["--parallelism.pipeline_parallel_degree", str(self.pp), "--parallelism.pipeline_parallel_schedule", self.schedule,
                     "--parallelism.pipeline_parallel_microbatch_size", "1"]
        return mesh + (["--parallelism.expert_parallel_degree", str(self.ep)] if self.ep > 1 else []) + self.dtype_flags

    def titan_stage_layers(self) -> list[int]:
        """Transformer layers per stage as torchtitan splits them (the embedding and the output count as a layer each),
        so that both trainers' stages hold the same layers."""
        from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

        stages = self.pp * (1 if self.schedule in ("1F1B", "GPipe") else 2)
        parts = generate_llm_fqn_per_model_part(stages, self.layers)
        return [sum(name.startswith("layers.") for name in part) for part in parts]

    def ac_flags(self) -> list[str]:
        return ["--activation_checkpoint.mode", self.ac] + (["--activation_checkpoint.selective_ac_option", "2"] if self.ac == "selective" else [])

    @property
    def ranks(self) -> int:
        return self.pp * self.dp_shard * self.tp

    @property
    def titan_model(self) -> str:
        return "gt_deepseek_v3" if self.model == "deepseek_v3" else "gt_llama3"

    @property
    def titan_flavor(self) -> str:
        return f"{self.flavor}-{self.layers}L" if self.layers else self.flavor


MULTI_CONFIGS = {
    2: [
        MultiConfig("1B dp2", "llama3", "1B", 0, 2, 4096, dp_shard=2),
        # torchtitan compile peaked at 39.9 GiB active on 2 H200s (bench/results/2026-11-28-auto-placed-4gpu, call 4);
        # with the fused loss the step peaks 0.4-0.5 GiB over the policy's simulated peak (39.4 GiB at a 39 GiB budget:
        # bench/results/2026-11-30-session27, call 7), so it runs at budgets under torchtitan's peak
        MultiConfig("8B-16L dp2", "llama3", "8B", 16, 1, 8192, dp_shard=2, ac="selective", memory_budgets=("39.5GiB", "39GiB")),
        MultiConfig("8B-16L tp2", "llama3", "8B", 16, 1, 8192, dp_shard=1, tp=2, ac="selective"),
        # torchtitan compile peaked at 30.7 GiB active on 2 H100s and on 2 H200s (2026-11-27-multi-2gpu, 2026-11-29-session20)
        MultiConfig("DeepSeek 16B-6L dp2 ep2", "deepseek_v3", "16B", 6, 2, 4096, dp_shard=2, ep=2, memory_budgets=("30GiB",)),
        # 8 microbatches of 1 x 4096: a stage's weights, gradients and AdamW moments unsharded (36 GiB for the first
        # stage's 2.3B parameters) leave an H100 room for the activations of the microbatches 1F1B keeps in flight
        MultiConfig("8B-16L pp2 1F1B", "llama3", "8B", 16, 8, 4096, dp_shard=1, ac="selective", pp=2, schedule="1F1B"),
        MultiConfig("8B-16L pp2 Interleaved1F1B", "llama3", "8B", 16, 8, 4096, dp_shard=1, ac="selective", pp=2,
                    schedule="Interleaved1F1B"),
    ],
    4: [
        # torchtitan compile peaks at 45.5 GiB active on 4 H100s and on 4 H200s (2026-11-27-multi-4gpu, 2026-11-28-compile-workers)
        MultiConfig("8B dp4", "llama3", "8B", 0, 1, 8192, dp_shard=4, ac="selective", memory_budgets=("45GiB",)),
        MultiConfig("8B dp2 tp2", "llama3", "8B", 0, 1, 8192, dp_shard=2, tp=2, ac="selective"),
        MultiConfig("1B dp4", "llama3", "1B", 0, 2, 4096, dp_shard=4),
        # 12 of 27 layers: 6.9B parameters, 25.8 GiB a rank of fp32 weights, gradients and AdamW moments over 4 ranks,
        # leave an H100 room for the activations of 2 x 4096 tokens (the 6-layer cut on 4 GPUs peaked at 24.2 GiB with
        # 12.8 GiB of them); the whole 16B holds 58.5 GiB a rank before any activation
        MultiConfig("DeepSeek 16B-12L dp4 ep4", "deepseek_v3", "16B", 12, 2, 4096, dp_shard=4, ep=4),
        MultiConfig("8B-16L pp2 dp2 1F1B", "llama3", "8B", 16, 8, 4096, dp_shard=2, ac="selective", pp=2, schedule="1F1B"),
        MultiConfig("8B-16L pp2 dp2 Interleaved1F1B", "llama3", "8B", 16, 8, 4096, dp_shard=2, ac="selective", pp=2,
                    schedule="Interleaved1F1B"),
    ],
}


def multi_runs(c: MultiConfig, steps: int) -> list[Run]:
    job = ["--model.name", c.model, "--model.flavor", c.flavor, "--training.seq_len", str(c.seq),
           "--training.batch_size", str(c.local_batch * c.dp_shard), "--training.steps", str(steps),
           "--training.random_tokens", "--training.no-deterministic", "--metrics.log_freq", "1",
           *(["--model.n_layers", str(c.layers)] if c.layers else []), *c.gt_flags()]
    base = job + c.ac_flags()

    def ours(name: str, group: str, extra: list[str], profile: bool = False) -> Run:
        return gt(name, group, base, extra, nproc=c.ranks, env=dict(NCCL_TUNING_LOG), profile=profile)

    # the production config of the model as shipped (its activation checkpointing: the memory policy filling the
    # device for llama3; the in-graph optimizer), on this config's model, mesh and tokens
    production = production_config(c.model, c.flavor)
    shipped = [gt("gt production config", c.group, job, production, nproc=c.ranks, env=dict(NCCL_TUNING_LOG), profile=True)
               ] if production and c.pp == 1 else []
    # the fused loss needs the whole vocabulary on the rank (not under tp)
    shipped += [replace(shipped[0], name="gt production config fused loss", args=shipped[0].args + FUSED_LOSS)
                ] if shipped and c.tp == 1 else []

    def theirs(name: str, group: str, extra: list[str], profile: bool = False) -> Run:
        run = titan(name, group, c.titan_flavor, c.local_batch, c.seq, steps, c.ranks, c.titan_flags() + c.ac_flags() + extra,
                    model=c.titan_model, profile=profile)
        run.env = dict(NCCL_TUNING_LOG)
        return run

    if c.pp > 1:
        # the same schedule, microbatches and tokens on both sides, the bubble from both profiles; ours with torchtitan's
        # stages, and with the split that balances the output projection's work (our best)
        titan_split = ["--parallelism.pp_layers_per_stage", ",".join(map(str, c.titan_stage_layers()))]
        balanced = ["--parallelism.pp_layers_per_stage", "balanced"]
        # FSDP gathered in each microbatch's forward and reduce-scattered in its backward, bucketed, against the default
        # (gathered once per step, 1.4x torchtitan's peak active memory): on 4 H100s the same 44.5 GiB peak and 0.93x
        # torchtitan compile (bench/results/2026-11-28-deepseek-capacity-and-pp-gather)
        microbatch = (["--parallelism.pp_gather", "microbatch", "--compile.passes", "auto_bucketing"]
                      if c.dp_shard > 1 else [])
        return [theirs("titan compile", c.group, ["--compile.enable"], profile=True),
                ours("gt full balanced", c.group, FULL + balanced, profile=True),
                *([ours("gt full balanced microbatch gather", c.group, FULL + balanced + microbatch, profile=True)]
                  if microbatch else []),
                ours("gt aot_fx_trace full", c.group, FULL + titan_split, profile=True),
                theirs("titan eager", c.group, []), ours("gt eager", c.group, ["--compile.mode", "eager"] + titan_split)]
    auto = f"{c.group} auto"
    # async_tp and tp_reduce_overlap (issue 33; on by default with tp on GPUs) against the same step without each,
    # beside torchtitan compile with its async TP; ep_overlap on top of the default passes
    schedule = ["separate_gather_group", "transformer_block_bucketing"] if c.dp_shard > 1 else []
    default = [*schedule, *(["async_tp", "tp_reduce_overlap"] if c.tp > 1 else [])]
    overlapped = [
        theirs("titan compile async TP", c.group, ["--compile.enable", "--parallelism.enable_async_tensor_parallel"]),
        ours("gt full no async_tp", c.group, FULL + ["--compile.passes", ",".join([*schedule, "tp_reduce_overlap"])], profile=True),
        # async_tp through NCCL collectives instead of symmetric memory: at 8B-16L tp 2 0.92x (in 2 slices) and 0.91x
        # (in 4) the default (bench/results/2026-11-30-session22)
        ours("gt full async_tp chunked 2", c.group, FULL + ["--compile.async_tp_lowering", "chunked"], profile=True),
        # the production configs' step without tp_reduce_overlap, against it (`gt full optimizer_in_graph`): at 8B-16L
        # tp 2 the reduce-scatters' exposed time 0.4 ms with the pass, 5.8-11.5 without; 1.03x (session 28, call 7)
        ours("gt full optimizer_in_graph no tp_reduce_overlap", c.group,
             FULL + IN_GRAPH_OPTIMIZER + ["--compile.passes", ",".join([*schedule, "async_tp"])], profile=True),
    ] if c.tp > 1 else []
    overlapped += [ours("gt full ep_overlap", c.group, FULL + ["--compile.passes", ",".join([*default, "ep_overlap"])],
                        profile=True)] if c.ep > 1 else []
    # MoE with the capacity of configs/deepseek_v3_16b.toml: without a limit each peer's dispatch buffer holds every
    # routed pair of the rank, ep x torchtitan's all-to-all bytes (0.94x torchtitan compile at dp_shard 4 x ep 4 on
    # 4 H100s, bench/results/2026-11-27-deepseek-dp4-ep4); at 2.0, 2x, with the drops counted in `dropped_tokens`
    # (1.10x, and 1.06x with ep_overlap: bench/results/2026-11-28-deepseek-capacity-and-pp-gather)
    capacity_2 = ["--parallelism.moe_capacity_factor", "2.0"]
    capacity = [ours("gt full capacity 2", c.group, FULL + capacity_2, profile=True),
                ours("gt full ep_overlap capacity 2", c.group, FULL + capacity_2 + ["--compile.passes", ",".join([*default, "ep_overlap"])],
                     profile=True)] if c.ep > 1 else []
    # the best manual configuration: aot_fx_trace, full Inductor and the default multi-rank overlap schedule
    return [
        theirs("titan eager", c.group, []),
        theirs("titan compile", c.group, ["--compile.enable"], profile=True),
        ours("gt eager", c.group, ["--compile.mode", "eager"]),
        ours("gt aot_fx_trace full", c.group, FULL, profile=True),
        # what recompute_pointwise (on by default) is worth: the same run saving SwiGLU's pointwise values
        ours("gt full no recompute_pointwise", c.group, FULL + ["--activation_checkpoint.recompute_pointwise", "false"]),
        *[ours(f"gt full memory_budget {b}{name}", c.group, FULL + ["--activation_checkpoint.mode", "memory_budget",
                                                                    "--activation_checkpoint.memory_budget", b] + loss, profile=True)
          for b in c.memory_budgets for name, loss in (("", []), (" fused loss", FUSED_LOSS),
                                                       (" fused loss optimizer_in_graph", FUSED_LOSS + IN_GRAPH_OPTIMIZER))],
        # the clip and AdamW update compiled into the step, against torch's fused AdamW after it
        ours("gt full optimizer_in_graph", c.group, FULL + IN_GRAPH_OPTIMIZER, profile=True),
        *capacity,
        *shipped,
        # the token embedding gathered as every parameter is (SimpleFSDP), where auto reads it in place (GPU, dp_shard
        # alone: parallel/vocab_embedding.py)
        *([ours("gt full embedding gather", c.group, FULL + ["--parallelism.embedding", "gather"], profile=True)]
          if c.tp == 1 and c.pp == 1 else []),
        # the same job started again: its time to first step with the compile cache the cold run filled
        replace(ours("gt full restart", c.group, FULL), warm_from="gt aot_fx_trace full"),
        # the cold compile without compile workers (passes/compile_workers.py): every piece compiled by each rank itself
        ours("gt full no compile workers", c.group, FULL + ["--compile.compile_workers", "0"]),
        # fixed numbers of compile workers a rank (auto: one per 4 cores of the rank's share of the node, 4 on 2 H200s)
        *[ours(f"gt full compile workers {n}", c.group, FULL + ["--compile.compile_workers", str(n)]) for n in (4, 8)],
        *overlapped,
        theirs("titan compile", auto, ["--compile.enable"]),
        ours("gt full auto-placed", auto, FULL + ["--compile.autoparallel"], profile=True),
        # the production config placed by the solver, against the same config placed by hand (our best manual step)
        *[replace(run, name="gt production config auto-placed", group=auto, args=run.args + ["--compile.autoparallel"])
          for run in shipped[:1]],
        ours("gt autoparallel_backend auto-placed", auto, TRACE + ["--compile.inductor_compilation", "autoparallel_backend",
                                                                   "--compile.autoparallel"], profile=True),
    ]


def suite_multi(steps: int, gpus: int) -> list[Run]:
    return [run for c in MULTI_CONFIGS[gpus] for run in multi_runs(c, steps)]


SAME_WEIGHTS_STEPS = 100
LOSS_BOUND = (0.025, 0.15)
"""Mean and max |loss difference| over the 100-step curves of two trainers from the same weights and tokens (bf16
compute, fp32 reduction; the loss is about 11.9 after step 2, so 0.2% and 1.3% of it): their kernels and reduction
orders differ from the first step on, and the curves drift apart as any two bf16 runs do. The bound is torchtitan's own
spread, measured on 2 x H100 (bench/results/2026-11-27-numerics.md): its compile against its eager, from the same
weights, mean 0.019 and max 0.106, with a third of that again as margin. The first bound (0.005, 0.02) was set before
any measurement; torchtitan missed it against itself by 4-5x. A wrong gradient shows at once: the step-1 losses of the
two trainers' eager runs differ by 3.4e-6 (the same weights), and the step-2 losses, after one update, by 3e-5. The report
gives the same figures for torchtitan compile against its own eager."""


def suite_numerics(steps: int, gpus: int) -> list[Run]:
    """On 2 GPUs: (a) graph-trainer and torchtitan from the same weights (our Hugging Face export of the 1B after one
    step, loaded by both) on the same tokens for 100 steps, curves within LOSS_BOUND; (b) deterministic aot_fx_trace
    run by FX equal to eager bit for bit: llama3 1B dp_shard 2 and tp 2, DeepSeek V3 debug dp_shard 2 x ep 2. The step
    counts are the checks' own (--steps does not apply)."""
    group = "1B same weights"
    one_b = ["--model.flavor", "1B", "--training.seq_len", "4096", "--training.batch_size", "4", "--training.random_tokens",
             "--training.no-deterministic", "--metrics.log_freq", "1", "--parallelism.dp_shard", "2"]
    curve = ["--training.steps", str(SAME_WEIGHTS_STEPS)]
    # torchtitan's schedule as ours (its default warms up over 200 steps)
    titan_schedule = ["--parallelism.data_parallel_shard_degree", "2", "--lr_scheduler.warmup_steps", "2"]

    def theirs(name: str, extra: list[str]) -> Run:
        return titan(name, group, "1B", 2, 4096, SAME_WEIGHTS_STEPS, 2, titan_schedule + extra)

    runs = [gt("gt export", group, one_b, ["--training.steps", "1", "--compile.mode", "eager", "--checkpoint.last_save_in_hf"], nproc=2),
            theirs("titan eager", []),
            theirs("titan compile", ["--compile.enable"]),
            gt("gt eager", group, one_b, curve + ["--compile.mode", "eager"], nproc=2),
            gt("gt aot_fx_trace full", group, one_b, curve + FULL, nproc=2)]
    for run, reference in zip(runs[1:], ("", "titan eager", "titan eager", "titan compile")):
        run.start_from = "gt export"
        if reference:
            run.bitwise_with, run.loss_bound = reference, LOSS_BOUND
    # Bitwise pairs run deterministic kernels; 2 sequences of 4096 a rank, as the one-GPU suite's 1B pair
    one_b_bitwise = ["--model.flavor", "1B", "--training.seq_len", "4096", "--training.steps", "5", "--training.random_tokens",
                     "--training.deterministic", "--metrics.log_freq", "1"]
    deepseek = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--training.seq_len", "2048", "--training.batch_size",
                "8", "--training.steps", "10", "--training.random_tokens", "--training.deterministic", "--metrics.log_freq", "1",
                "--parallelism.dp_shard", "2", "--parallelism.ep", "2"]
    for group, flags in (("1B dp2 bitwise", one_b_bitwise + ["--training.batch_size", "4", "--parallelism.dp_shard", "2"]),
                         ("1B tp2 bitwise", one_b_bitwise + ["--training.batch_size", "2", "--parallelism.tp", "2"]),
                         ("DeepSeek debug dp2 ep2 bitwise", deepseek)):
        runs += [gt("gt eager", group, flags, ["--compile.mode", "eager"], nproc=2),
                 gt("gt aot_fx_trace", group, flags, FX, nproc=2, bitwise_with="gt eager")]
    return runs


def suite_h200x2(steps: int, gpus: int) -> list[Run]:
    eight_b = ["--model.flavor", "8B", "--training.seq_len", "8192", "--training.batch_size", "2", "--training.steps",
               str(steps), "--training.random_tokens", "--training.no-deterministic", "--parallelism.dp_shard", "2",
               "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"]
    trace = ["--compile.mode", "aot_fx_trace"]
    return [
        titan("titan eager", "8B", "8B", 1, 8192, steps, 2, ["--activation_checkpoint.mode", "selective"]),
        titan("titan compile", "8B", "8B", 1, 8192, steps, 2, ["--activation_checkpoint.mode", "selective", "--compile.enable"]),
        gt("gt eager", "8B", eight_b, ["--compile.mode", "eager"], nproc=2),
        gt("gt aot_fx_trace full + auto_bucketing", "8B", eight_b,
            trace + ["--compile.inductor_compilation", "full", "--compile.passes", "auto_bucketing"], nproc=2),
        gt("gt aot_fx_trace autoparallel_backend", "8B", eight_b, trace + ["--compile.inductor_compilation", "autoparallel_backend"], nproc=2),
        gt("gt auto-placed autoparallel_backend", "8B", eight_b,
            trace + ["--compile.inductor_compilation", "autoparallel_backend", "--compile.autoparallel"], nproc=2),
    ]
