"""Job configuration: dataclass sections named as in torchtitan, loaded from TOML and CLI flags.

The sections are plain dataclasses so that tyro can render `--help` from them and the rest of the
package can read them without a parser in sight. Values are parsed here, strictly: an unknown key or
a value of the wrong type raises `ConfigError`, whose message is one line naming the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal


class ConfigError(ValueError):
    """A configuration the user must fix; the CLI prints it as one line and exits with code 2."""


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Folder for metrics.jsonl, config.toml, graph dumps and (by default) checkpoints."""
    description: str = "graph-trainer job"
    """Free text recorded in config.toml."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family: llama3, deepseek_v3 or qwen3."""
    flavor: str = "debugmodel"
    """Size of the model inside its family (e.g. debugmodel, 1B, 8B, 70B, 16B, 671B)."""
    tokenizer_path: str = ""
    """A HF tokenizer.json (file or folder). Empty: the tokenizer shipped with the package."""
    n_layers: int = 0
    """Override the flavor's number of layers (0 keeps it); for benchmarks of a model cut short."""
    attention: Literal["flavor", "sdpa"] = "flavor"
    """flavor: the flavor's attention (FlexAttention with document masks for llama3 *_flex_attn and
    DeepSeek V3 16B/236B/671B, as torchtitan); sdpa: causal SDPA over packed documents instead."""


@dataclass
class Training:
    steps: int = 20
    """Number of optimizer steps."""
    batch_size: int = 8
    """Global batch size in sequences per optimizer step, split over the data-parallel ranks."""
    seq_len: int = 256
    """Tokens per sequence."""
    gradient_accumulation_steps: int = 1
    """Microbatches per optimizer step on each rank."""
    max_norm: float = 1.0
    """Gradient clipping by total norm (0 disables clipping)."""
    dataset_path: str = ""
    """A .txt, .jsonl or .parquet file or a folder of them. Empty: the corpus shipped with the package."""
    seed: int = 0
    """Seed for weights and data; every rank uses the same weights."""
    deterministic: bool = True
    """Deterministic kernels: bitwise-reproducible runs, and traced modes bitwise equal to eager. On a GPU
    it costs speed (deterministic attention backward, no cuDNN attention)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype parameters, gradients and optimizer states are stored in (torchtitan's --training.dtype). bfloat16 trains
    in bf16 throughout, without fp32 weights (computed in bf16, gradients still reduced in mixed_precision_reduce);
    torchtitan's only bf16 training on a mesh of TP or PP without FSDP, where it has no mixed precision."""
    mixed_precision_param: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype parameters are gathered and computed in; auto: bfloat16 on GPU, float32 on CPU (bfloat16 with
    --training.dtype bfloat16)."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype gradients are reduced in across data-parallel ranks."""
    random_tokens: bool = False
    """Train on random token ids instead of the corpus (throughput benchmarks)."""
    loss: Literal["cross_entropy", "fused_linear_ce"] = "cross_entropy"
    """fused_linear_ce: the output projection and cross-entropy chunked over tokens, so the [tokens, vocab]
    logits never exist whole (saves about their fp32 size at a 128k vocabulary)."""
    loss_chunk_tokens: int = 2048
    """With --training.loss fused_linear_ce: tokens per chunk (each chunk's logits are chunk x vocab)."""


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer (torchtitan's builder)."""
    lr: float = 8e-4
    """Peak learning rate."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """The update's kernels (torch.optim): "auto" is fused on GPU, foreach on CPU."""


@dataclass
class LRScheduler:
    warmup_steps: int = 2
    """Linear warm-up steps."""
    decay_ratio: float = -1.0
    """Share of steps spent decaying at the end (negative: decay over all steps after warm-up)."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay."""
    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of the peak."""


@dataclass
class Parallelism:
    dp_replicate: int = 1
    """Replicated data-parallel degree (HSDP's outer dimension: gradients all-reduced)."""
    dp_shard: int = -1
    """Sharded data-parallel degree (SimpleFSDP); -1 takes the ranks left after the others."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row plans with sequence-parallel norms)."""
    ep: int = 1
    """Expert-parallel degree for MoE models; must divide dp_shard * tp."""
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward and gather again in backward: always, never, or default (all but the
    final norm and output, which backward needs first), in every mode."""
    embedding: Literal["auto", "gather", "vocab"] = "auto"
    """How a rank reads the token embedding, sharded by rows over dp_shard: `gather` all-gathers it where it is read
    and reduce-scatters its gradient (SimpleFSDP, as every parameter); `vocab` all-gathers the ranks' token ids, looks
    them up in the rank's own rows and reduce-scatters the embeddings to their ranks (the gradient likewise), moving
    dp_shard x tokens x dim activations in place of vocab x dim weights at the two ends of the step; needs the manual
    placement and no tp (dp_replicate and pp are fine). auto: vocab on GPUs where that moves fewer bytes (dp_shard x tokens a
    rank < vocab), else gather."""
    moe_capacity_factor: float = 0.0
    """Expert-parallel dispatch buffer per peer as a multiple of the even share; 0: no token is ever dropped."""
    pp: int = 1
    """Pipeline-parallel degree: the layers split into stages over this many ranks (outermost mesh dimension)."""
    pp_schedule: Literal["1F1B", "Interleaved1F1B", "GPipe", "InterleavedZeroBubble"] = "1F1B"
    """torch.distributed.pipelining schedule; the interleaved ones run pp_stages_per_rank stages on each rank."""
    pp_microbatches: int = 0
    """Microbatches each pipeline step splits the rank's batch into; 0: one per stage."""
    pp_stages_per_rank: int = 0
    """Stages on each pp rank: 1 for 1F1B and GPipe; 0 means 1 for those, 2 for the interleaved schedules."""
    pp_gather: Literal["step", "microbatch"] = "step"
    """With FSDP under pp: `step` gathers each stage parameter once per pipeline step and reduce-scatters its gradient
    once, holding the rank's stage parameters unsharded (compute dtype) with fp32 gradient sums through the step, 6 bytes
    a parameter with bf16; `microbatch` gathers in every microbatch's forward and reduce-scatters in its backward (the
    parameters unsharded only while a graph runs; bitwise the pp 1 step, where `step` adds the microbatches' gradients
    before averaging; on 4 H100s, 8B-16L, the same peak memory as `step` and slower)."""
    pp_layers_per_stage: list[str] = field(default_factory=list)
    """Transformer layers in each stage, comma separated (e.g. 1,3); empty: an even split; `balanced`: the split that evens
    out the ranks' and stages' FLOPs (the output projection weighs as much as two 8B layers). The first stage also holds
    the embedding, the last the final norm and output."""


CACHE_OFF = ("", "off")
"""`--compile.cache_dir` values that turn the compile cache off."""
CACHE_DEFAULT = "auto"
"""`--compile.cache_dir`'s default: `<job.dump_folder>/compile_cache`."""
CACHED_BACKENDS = ("full", "autoparallel_backend")
"""The backends whose compiles are stored (compile_cache.py): whole graphs (or their pieces) through `standalone_compile`."""


def cache_folder(cfg: "JobConfig | None") -> Path | None:
    """Where this job's compiled graphs are stored, or None when the cache is off (or no job config)."""
    if cfg is None or cfg.compile.cache_dir in CACHE_OFF:
        return None
    if cfg.compile.cache_dir == CACHE_DEFAULT:
        return Path(cfg.job.dump_folder) / "compile_cache"
    return Path(cfg.compile.cache_dir)


@dataclass
class Compile:
    mode: Literal["eager", "jit", "aot", "aot_fx_trace"] = "aot_fx_trace"
    """How the train step is captured (aot_fx_trace: forward, loss and backward as one traced graph)."""
    passes: list[str] = field(default_factory=list)
    """Graph passes in order, comma separated (see --compile.list_passes). Empty: in multi-rank aot_fx_trace the overlap
    schedule where parameters are sharded (separate_gather_group, transformer_block_bucketing), then async_tp with tp on
    GPUs; nothing otherwise; `none`: no pass."""
    async_tp_lowering: Literal["auto", "symm_mem", "chunked"] = "auto"
    """How async_tp overlaps a TP collective with its matmuls: symm_mem (torch's fused symmetric-memory ops, peer-to-peer
    copies on the copy engines; CUDA and a real process group), chunked (each rank's rows cut into async_tp_chunks
    slices, one functional collective each, issued before the previous slice's matmul; any device); auto = symm_mem
    where it can run, else chunked."""
    async_tp_chunks: int = 2
    """Slices of each rank's rows in async_tp's chunked lowering (>= 2): the first slice's gather and the last one's
    reduce-scatter are what it leaves exposed."""
    inductor_compilation: Literal["auto", "none", "regional", "full", "autoparallel_backend"] = "auto"
    """Backend the traced train step goes to; auto = full (whole-step Inductor) on GPUs, none (FX) on CPU."""
    autoparallel: bool = False
    """Let the built-in solver choose placements on the mesh the parallelism degrees define."""
    autoparallel_impl: Literal["builtin", "meta"] = "builtin"
    """Solver implementation: ours, or Meta's autoparallel package if installed."""
    autoparallel_memory_budget: str = ""
    """Per-rank memory cap of a plan: a fraction of device memory (0.5) or GiB (20GiB). The built-in solver counts
    parameters, gradients, optimizer state and the activations the AC policy keeps (default: device memory less 8 GiB); Meta's placer
    parameters alone (default 0.5)."""
    autoparallel_plan: str = ""
    """Reuse a plan.json written by `graph-trainer plan` instead of solving."""
    hardware: Literal["auto", "h100", "h200", "cpu"] = "auto"
    """Device the cost models price for (solver, scheduling passes, prediction.json): auto = the one the job runs on."""
    dump_graphs: bool = False
    """Write the graph after each stage and summary.json under <dump_folder>/graphs/."""
    list_passes: bool = False
    """Print the pass registry as a table and exit."""
    optimizer_in_graph: bool = False
    """aot_fx_trace: gradient clipping and the AdamW update traced into the train-step graph and compiled with it."""
    cache_dir: str = "auto"
    """Where full Inductor stores each compiled graph, keyed by the graph (after the passes), torch/Triton versions, device
    kind, mesh and Inductor options, so the next start of the same job loads it instead of compiling (also on every rank);
    the traced step is stored there too (traces/, keyed by the code, config, placements, inputs and, where ranks' graphs
    differ, the rank), and the step the passes and the compile made of it (steps/, the same key with the communication
    mode and world size: the pieces, their order and the passes' plan), so a restart neither traces nor runs a pass when
    every rank has its entry and the start dumps no graphs (the step-1 record's step_cache: hit, miss or refused
    (why)). auto = <job.dump_folder>/compile_cache; off (or empty) compiles and traces every time. `graph-trainer
    precompile` fills it."""
    block_reuse: bool = True
    """Full Inductor: cut the aot_fx_trace step (or aot's and pipeline stages' forward and backward graphs) at every
    block, communication run and in-graph parameter update, and compile each distinct piece once, when the distinct
    pieces hold at most half a graph's ops (false: compile each graph whole)."""
    compile_workers: int = -1
    """Processes per rank that compile the distinct pieces of a block-reused step in parallel, into the compile cache
    (needs it on), started by `graph-trainer train` before its imports where the job will trace and compile its step
    (else where the step is about to be traced). -1 = auto, on a GPU: one per 2 CPU cores on a rank alone on its
    node (LOCAL_WORLD_SIZE 1: one GPU, `graph-trainer precompile`), one per 4 cores of the rank's share of the node
    where it has LOCAL_WORLD_SIZE ranks; on CPU none. 0: the rank compiles every piece itself."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective", "memory_budget"] = "none"
    """Recompute activations in backward: none, every block (full), selected ops/blocks, or per activation
    under --activation_checkpoint.memory_budget (aot_fx_trace)."""
    selective_ac_option: str = "2"
    """selective: an integer N checkpoints every N-th block; 'op' saves matmul/attention outputs, recomputes the rest."""
    memory_budget: str = ""
    """memory_budget mode: per-GPU memory for parameters, gradients, optimizer state and saved activations, in GiB
    (20GiB) or as a fraction of device memory (0.5); empty: the device's memory less a margin (units.fill_device)."""
    offload: Literal["auto", "never", "always"] = "auto"
    """memory_budget mode in aot_fx_trace: move activations to pinned host memory after forward and back before
    backward. auto: those whose copies compute hides, when the budget needs it (never on CPU, nor under a whole-graph
    Inductor compile); always: every activation that can be (to test it); never."""
    recompute_pointwise: bool = True
    """aot_fx_trace: recompute in backward what pointwise ops make inside a block from saved values (SwiGLU's silu
    and product, casts) instead of saving it, as a partitioning compiler does (passes/pointwise_recompute.py)."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save and resume with torch.distributed.checkpoint."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 0
    """Keep only the newest k checkpoints (0 keeps all)."""
    load_step: int = -1
    """Resume from this step (-1: the latest complete checkpoint)."""
    fallback_to_previous: bool = False
    """If the latest checkpoint is corrupt, resume from the newest good one instead of stopping."""
    initial_load_path: str = ""
    """Start from these weights when there is no checkpoint to resume from: a Hugging Face folder (with
    --checkpoint.initial_load_in_hf) or one of our DCP step folders (its model weights only)."""
    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face safetensors checkpoint (one file, or sharded with an index)."""
    last_save_in_hf: bool = False
    """At the end of the run also write the model as a Hugging Face checkpoint: <folder>/step-N-hf/."""


@dataclass
class Metrics:
    log_freq: int = 1
    """Log every this many steps."""
    progress_bar: bool = True
    """Show a progress bar on rank 0 when stderr is a terminal."""
    enable_tensorboard: bool = False
    """Also write each logged step's figures as TensorBoard scalars under <dump_folder>/tb/."""
    enable_wandb: bool = False
    """Also log each step's figures to Weights & Biases (needs the wandb package; WANDB_* variables configure it)."""


@dataclass
class Validation:
    enable: bool = False
    """Every `freq` steps and at the last, the loss and perplexity on held-out data (forward only), logged as
    validation_loss / validation_perplexity. Needs dataset_path or split."""
    dataset_path: str = ""
    """Validation data: a .txt, .jsonl or .parquet file or a folder of them, as training.dataset_path."""
    split: float = 0.0
    """Hold out this share of the training documents (the last ones) for validation: training never sees them,
    with validation enabled or not. 0: none (then give dataset_path)."""
    freq: int = 10
    """Validate every this many steps (and at the last step)."""
    steps: int = 10
    """Batches per validation, each of training.batch_size sequences, from the start of the validation data each time."""


@dataclass
class Profiling:
    enable: bool = False
    """Profile a few steps: Chrome trace and summary.json (top kernels, exposed communication) under <dump_folder>/profile/."""
    start_step: int = 6
    """First profiled step (after warm-up and compilation)."""
    steps: int = 2
    """Number of profiled steps."""
    memory_snapshot: bool = False
    """Record the CUDA allocator's history over the profiled steps (with or without --profiling.enable): rank 0 writes
    profile/memory_snapshot.pickle (for pytorch.org/memory_viz) and profile/memory_peak.json, what was allocated at the
    peak, by the line that allocated it (a compiled graph's line names the graph nodes it computes)."""


@dataclass
class Comm:
    timeout_seconds: int = 300
    """A train step not finished after this many seconds (a peer rank died or stopped answering) ends
    the rank with exit code 4; outside the steps (start-up, checkpoints) collectives time out 30 s later."""
    mode: Literal["real", "fake"] = "real"
    """real: one process per rank (torchrun). fake: ONE process runs rank fake_rank of a fake_world_size-rank job on
    torch's fake process group: real per-rank shapes and compute, collectives move no data (losses are not meaningful)."""
    fake_world_size: int = 1
    """With --comm.mode fake: the number of ranks simulated."""
    fake_rank: int = 0
    """With --comm.mode fake: which rank of fake_world_size this process is."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    compile: Compile = field(default_factory=Compile)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)


DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml"


def sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def valid_keys() -> dict[str, list[str]]:
    return {s: [f.name for f in dataclasses.fields(cls)] for s, cls in sections().items()}


def _suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(value: object, hint: object, where: str) -> object:
    """Turn a TOML value or a CLI string into the field's type, or raise a one-line ConfigError."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{where} must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if origin is list:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ConfigError(f"{where} must be a comma-separated list of names, got {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return str(value)
    raise AssertionError(f"unhandled config type {hint} for {where}")


def set_value(cfg: JobConfig, section: str, key: str, value: object, source: str) -> None:
    keys = valid_keys()
    if section not in keys:
        raise ConfigError(
            f"unknown section {section!r} in {source}{_suggest(section, list(keys))}; "
            f"valid sections: {', '.join(keys)}"
        )
    if key not in keys[section]:
        raise ConfigError(
            f"unknown key {section}.{key} in {source}{_suggest(key, keys[section])}; "
            f"valid keys of [{section}]: {', '.join(keys[section])}"
        )
    part = getattr(cfg, section)
    hint = typing.get_type_hints(type(part))[key]
    setattr(part, key, _coerce(value, hint, f"{section}.{key}"))


def load_toml(path: str | Path, cfg: JobConfig | None = None) -> JobConfig:
    cfg = cfg or JobConfig()
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing --config FILE.toml")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML ({e}); fix the file") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(
                f"top-level key {section!r} in {path} must be a [section]{_suggest(section, list(valid_keys()))}; "
                f"valid sections: {', '.join(valid_keys())}"
            )
        for key, value in table.items():
            set_value(cfg, section, key, value, str(path))
    return cfg


def _split_flag(arg: str) -> tuple[str, str | None]:
    name, eq, value = arg[2:].partition("=")
    return name.replace("-", "_"), (value if eq else None)


def parse_args(argv: list[str]) -> JobConfig:
    """`--config F.toml` first (default: configs/llama3_debug.toml), then `--section.key value` flags."""
    argv = list(argv)
    config_path: str | None = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--config" or argv[i].startswith("--config="):
            if "=" in argv[i]:
                config_path = argv[i].split("=", 1)[1]
            elif i + 1 < len(argv):
                config_path = argv[i + 1]
                i += 1
            else:
                raise ConfigError("--config needs a file: --config configs/llama3_debug.toml")
        else:
            rest.append(argv[i])
        i += 1
    cfg = load_toml(config_path) if config_path else (load_toml(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else JobConfig())

    keys = valid_keys()
    all_flags = [f"--{s}.{k}" for s, ks in keys.items() for k in ks]
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"unexpected argument {arg!r}{_suggest(arg, all_flags)}; flags look like --training.steps 20 "
                "(see --help)"
            )
        name, value = _split_flag(arg)
        section, _, key = name.partition(".")
        negated = key.startswith("no_") and section in keys and key[3:] in keys[section]
        if negated:
            key = key[3:]
        if section not in keys or key not in keys[section]:
            raise ConfigError(f"unknown flag {arg.split('=')[0]}{_suggest(arg.split('=')[0], all_flags)}; see --help for the valid flags")
        hint = typing.get_type_hints(type(getattr(cfg, section)))[key]
        if hint is bool and value is None:
            is_value_next = i + 1 < len(rest) and rest[i + 1].lower() in ("true", "false")
            value = rest[i + 1] if is_value_next and not negated else str(not negated)
            i += 1 if is_value_next and not negated else 0
        elif value is None:
            if i + 1 >= len(rest):
                raise ConfigError(f"flag {arg} needs a value, e.g. {arg} VALUE")
            value = rest[i + 1]
            i += 1
        set_value(cfg, section, key, value, "the command line")
        i += 1
    return cfg


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML that `load_toml` reads back to an equal config."""
    lines: list[str] = []
    for section in valid_keys():
        lines.append(f"[{section}]")
        for key, value in dataclasses.asdict(getattr(cfg, section)).items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
