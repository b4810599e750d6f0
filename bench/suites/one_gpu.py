"""Suites of one GPU: `h100` (llama3 1B, every mode and backend against torchtitan; debug models; bitwise checks; the
whole-step levers; Meta's placer) and `flex` (FlexAttention flavors)."""

from __future__ import annotations

from runs import FULL, FX, MEMORY_BUDGET, META_PLACED, TRACE, Run, gt, production_config, titan


def suite_h100(steps: int, gpus: int) -> list[Run]:
    one_b = ["--model.flavor", "1B", "--training.seq_len", "4096", "--training.batch_size", "4", "--training.steps",
             str(steps), "--training.random_tokens", "--training.no-deterministic", "--metrics.log_freq", "1"]
    debug = ["--model.flavor", "debugmodel", "--training.seq_len", "2048", "--training.batch_size", "8",
             "--training.steps", str(steps * 2), "--training.random_tokens", "--training.deterministic"]
    flex = [*debug[:1], "debugmodel_flex_attn", *debug[2:]]
    deepseek = ["--model.name", "deepseek_v3", *debug]
    # Bitwise pairs run deterministic kernels; batch 2 because unfused FX execution needs more memory.
    bitwise_1b = ["--model.flavor", "1B", "--training.seq_len", "4096", "--training.batch_size", "2", "--training.steps",
                  "5", "--training.random_tokens"]
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
        titan("titan eager", "1B", "1B", 4, 4096, steps, 1, []),
        titan("titan compile", "1B", "1B", 4, 4096, steps, 1, ["--compile.enable"], profile=True),
        titan("titan simple_fsdp compile", "1B", "1B", 4, 4096, steps, 1, simple_fsdp, model="gt_simple_fsdp_llama3"),
        gt("gt eager", "1B", one_b, ["--compile.mode", "eager"]),
        gt("gt jit full", "1B", one_b, ["--compile.mode", "jit", "--compile.inductor_compilation", "full"]),
        gt("gt aot full", "1B", one_b, ["--compile.mode", "aot", "--compile.inductor_compilation", "full"]),
        gt("gt aot_fx_trace full", "1B", one_b, FULL, profile=True),
        gt("gt aot_fx_trace autoparallel_backend", "1B", one_b, TRACE + ["--compile.inductor_compilation", "autoparallel_backend"]),
        gt("gt aot_fx_trace regional", "1B", one_b, TRACE + ["--compile.inductor_compilation", "regional"]),
        gt("gt aot_fx_trace full + cudagraph", "1B", one_b, FULL + ["--compile.passes", "cudagraph"]),
        gt("gt aot_fx_trace full tuned kernels", "1B", one_b, FULL, env=tuned),
        gt("gt aot_fx_trace full auto-placed", "1B", one_b, FULL + ["--compile.autoparallel"], profile=True),
        gt("gt eager deterministic", "1B bitwise", bitwise_1b, ["--compile.mode", "eager"]),
        gt("gt aot_fx_trace deterministic", "1B bitwise", bitwise_1b, FX, bitwise_with="gt eager deterministic"),
        gt("gt debug eager", "debug", debug, ["--compile.mode", "eager"]),
        gt("gt debug aot_fx_trace", "debug", debug, FX, bitwise_with="gt debug eager"),
        gt("gt debug full", "debug", debug, FULL),
        gt("gt debug full + cudagraph", "debug", debug, FULL + ["--compile.passes", "cudagraph"], bitwise_with="gt debug full"),
        gt("gt deepseek eager", "deepseek debug", deepseek, ["--compile.mode", "eager"]),
        gt("gt deepseek aot_fx_trace", "deepseek debug", deepseek, FX, bitwise_with="gt deepseek eager"),
        gt("gt deepseek aot_fx_trace auto-placed", "deepseek debug", deepseek, FX + ["--compile.autoparallel"]),
        gt("gt flex eager", "debug flex", flex, ["--compile.mode", "eager"]),
        gt("gt flex aot_fx_trace", "debug flex", flex, FX),
        gt("gt flex aot_fx_trace regional", "debug flex", flex, TRACE + ["--compile.inductor_compilation", "regional"]),
        gt("gt flex aot_fx_trace full", "debug flex", flex, FULL),
        # Whole-step levers on the 1B, alone and combined, beside torchtitan compile in the same call.
        titan("titan compile", "levers", "1B", 4, 4096, steps, 1, ["--compile.enable"]),
        gt("gt aot_fx_trace full", "levers", one_b, FULL),
        gt("gt full + optimizer_in_graph", "levers", one_b, FULL + in_graph_optimizer),
        gt("gt full + fused loss", "levers", one_b, FULL + fused_loss),
        gt("gt full + fused loss chunk 8192", "levers", one_b, FULL + fused_loss + ["--training.loss_chunk_tokens", "8192"]),
        # The 1B keeps 21.3 GiB of parameters, gradients and AdamW state: 36 / 30 GiB leave 14.7 / 8.7 GiB
        # for saved activations (35 GiB without AC, as the pass counts them before Inductor).
        gt("gt full + memory_budget 36GiB", "levers", one_b, FULL + MEMORY_BUDGET + ["36GiB"], profile=True),
        gt("gt full + memory_budget 30GiB", "levers", one_b, FULL + MEMORY_BUDGET + ["30GiB"]),
        gt("gt full + optimizer_in_graph + fused loss", "levers", one_b, FULL + in_graph_optimizer + fused_loss, profile=True),
        gt("gt full + optimizer_in_graph + fused loss + memory_budget", "levers", one_b,
            FULL + in_graph_optimizer + fused_loss + ["--activation_checkpoint.mode", "memory_budget"]),
        # configs/llama3_1b.toml as shipped, as the README's one-GPU example runs it
        gt("gt production config", "levers", one_b, production_config("llama3", "1B")),
        # Meta's AutoParallel placing the model (needs its da99589 wheel carried: docs/placement.md, "Meta's AutoParallel")
        gt("gt aot_fx_trace full", "meta", one_b, FULL),
        gt("gt aot_fx_trace meta-placed", "meta", one_b, FX + META_PLACED),
        gt("gt aot_fx_trace full meta-placed", "meta", one_b, FULL + META_PLACED),
        Run("gt aot_fx_trace full", "gt", 1, eight_b_fake + FULL, group="meta 8B dp8 fake", torchrun=False),
        # Meta's placed forward is its own graph, which block AC never reaches: both sides under the memory policy
        Run("gt full + memory_budget 45GiB", "gt", 1, eight_b_fake + FULL + MEMORY_BUDGET + ["45GiB"], group="meta 8B dp8 fake",
            torchrun=False),
        Run("gt full meta-placed + memory_budget 45GiB", "gt", 1, eight_b_fake + FULL + META_PLACED + MEMORY_BUDGET + ["45GiB"],
            group="meta 8B dp8 fake", torchrun=False),
    ]




def suite_flex(steps: int, gpus: int) -> list[Run]:
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
        runs += [gt("gt eager", group, speed, ["--compile.mode", "eager"]),
                 gt("gt aot_fx_trace regional", group, speed, regional, profile=True),
                 gt("gt aot_fx_trace full", group, speed, full, profile=True)]
    # the whole-step levers on top of full Inductor (the scale suite's best configuration)
    runs.append(gt("gt full + optimizer_in_graph + fused loss", "1B flex", flags("1B_flex_attn", 4096, 4, steps, False),
                    full + ["--compile.optimizer_in_graph", "--training.loss", "fused_linear_ce"], profile=True))
    # Parity: Inductor fuses the attention region's ops (RoPE, casts) that eager runs one by one, so bf16
    # results may differ in the last bits; the bound is 2% relative on losses and grad norms over 8 steps.
    parity = flags("debugmodel_flex_attn", 2048, 8, 8, True)
    group = "debug flex parity"
    runs += [gt("gt eager deterministic", group, parity, ["--compile.mode", "eager"])]
    for name, extra in (("gt aot_fx_trace regional deterministic", regional), ("gt aot_fx_trace full deterministic", full)):
        run = gt(name, group, parity, extra, bitwise_with="gt eager deterministic")
        run.bound = 0.02
        runs.append(run)
    return runs


