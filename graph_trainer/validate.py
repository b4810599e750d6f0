"""Every up-front check of a config, in one place, run before any process group or model exists.

Each failure is a `ConfigError` whose message is one line naming the fix. Only cheap facts are used:
the world size from the environment torchrun sets, the model's argument dataclass, file existence,
and the pass registry's declared constraints.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import models
from .config import ConfigError, JobConfig
from .defaults import resolve
from .units import parse_memory_budget


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_comm(cfg: JobConfig) -> None:
    """`--comm.mode fake` runs one rank of a job of `fake_world_size` ranks in this one process."""
    c = cfg.comm
    if c.mode != "fake":
        if (c.fake_world_size, c.fake_rank) != (1, 0):
            raise ConfigError("comm.fake_world_size and comm.fake_rank simulate a job in one process: add --comm.mode fake")
        return
    if c.fake_world_size < 1:
        raise ConfigError(f"comm.fake_world_size must be >= 1 (the number of ranks simulated), got {c.fake_world_size}")
    if not 0 <= c.fake_rank < c.fake_world_size:
        raise ConfigError(f"comm.fake_rank={c.fake_rank} is not a rank of {c.fake_world_size}; pick --comm.fake_rank in 0..{c.fake_world_size - 1}")
    if world_size_from_env() > 1:
        raise ConfigError(f"--comm.mode fake simulates all {c.fake_world_size} ranks in one process: run it without torchrun "
                          f"(WORLD_SIZE={world_size_from_env()} is set), or drop --comm.mode fake")
    if cfg.checkpoint.enable:
        raise ConfigError("--comm.mode fake cannot checkpoint (its collectives move no data, so its weights are not the job's): "
                          "drop --checkpoint.enable")


def check_mesh(cfg: JobConfig, world_size: int) -> tuple[int, int, int, int]:
    p = cfg.parallelism
    for name in ("dp_replicate", "tp", "ep"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallelism.{name} must be >= 1, got {getattr(p, name)}")
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise ConfigError(f"parallelism.dp_shard must be -1 (fill) or >= 1, got {p.dp_shard}")
    if p.pp < 1:
        raise ConfigError(f"parallelism.pp must be >= 1, got {p.pp}")
    if world_size % p.pp:
        raise ConfigError(f"world size {world_size} is not divisible by parallelism.pp={p.pp}; change --parallelism.pp or the number of ranks")
    # the other degrees fill one pipeline rank's share of the ranks
    world_size //= p.pp
    dp_shard = p.dp_shard
    if dp_shard == -1:
        if world_size % (p.dp_replicate * p.tp):
            raise ConfigError(
                f"world size {world_size} is not divisible by dp_replicate * tp = {p.dp_replicate * p.tp}; "
                "change --parallelism.tp/--parallelism.dp_replicate or the number of ranks"
            )
        dp_shard = world_size // (p.dp_replicate * p.tp)
    product = p.dp_replicate * dp_shard * p.tp
    if product != world_size:
        raise ConfigError(
            f"dp_replicate({p.dp_replicate}) * dp_shard({dp_shard}) * tp({p.tp}) = {product} but there are "
            f"{world_size} ranks; set degrees whose product is {world_size} (or --parallelism.dp_shard -1)"
        )
    if p.ep > 1 and (dp_shard * p.tp) % p.ep:
        raise ConfigError(
            f"parallelism.ep={p.ep} must divide dp_shard * tp = {dp_shard * p.tp} (expert parallelism borrows those ranks)"
        )
    return p.dp_replicate, dp_shard, p.tp, p.ep


def check_model(cfg: JobConfig, degrees: tuple[int, int, int, int]) -> None:
    name, flavor = cfg.model.name, cfg.model.flavor
    if name not in models.model_names():
        raise ConfigError(f"unknown model {name!r}; --model.name must be one of {', '.join(models.model_names())}")
    spec = models.get_spec(name)
    if flavor not in spec.flavors:
        raise ConfigError(f"unknown flavor {flavor!r} of {name}; --model.flavor must be one of {', '.join(spec.flavors)}")
    args = spec.flavors[flavor]
    _, _, tp, ep = degrees
    heads = [("n_heads", args.n_heads)] + ([("n_kv_heads", args.n_kv_heads)] if getattr(args, "n_kv_heads", None) else [])
    for field, count in heads:
        if count % tp:
            raise ConfigError(f"parallelism.tp={tp} does not divide {name} {flavor}'s {field}={count}; pick a tp that divides it")
    if ep > 1:
        if not spec.is_moe or not getattr(args, "moe_enabled", True):
            raise ConfigError(f"parallelism.ep={ep} needs an MoE model; {name} {flavor} has no experts (set --parallelism.ep 1)")
        experts = args.moe_args.num_experts
        if experts % ep:
            raise ConfigError(f"parallelism.ep={ep} does not divide {name} {flavor}'s {experts} experts; pick an ep that divides it")
    if cfg.model.n_layers < 0:
        raise ConfigError(f"model.n_layers must be >= 0 (0 keeps the flavor's), got {cfg.model.n_layers}")


def check_data_path(path: str, flag: str) -> None:
    """The data files a path names exist, open in their format and hold a document at their start (a
    fault further into a file is found, as one line too, when the first run tokenizes it)."""
    from .data.corpus import DataError, check_readable, data_files

    try:
        check_readable(data_files(path))
    except DataError as e:
        raise ConfigError(f"{flag}: {e}") from None


def check_training(cfg: JobConfig, degrees: tuple[int, int, int, int]) -> None:
    t = cfg.training
    for name in ("steps", "batch_size", "seq_len", "gradient_accumulation_steps"):
        if getattr(t, name) < 1:
            raise ConfigError(f"training.{name} must be >= 1, got {getattr(t, name)}")
    dp = degrees[0] * degrees[1]
    per_step = dp * t.gradient_accumulation_steps
    if t.batch_size % per_step:
        raise ConfigError(
            f"training.batch_size={t.batch_size} is not divisible by dp degree ({dp}) * gradient_accumulation_steps "
            f"({t.gradient_accumulation_steps}) = {per_step}; use a multiple of {per_step}"
        )
    if t.dataset_path:
        check_data_path(t.dataset_path, "--training.dataset_path")
    if cfg.model.tokenizer_path:
        from .data.tokenizer import TokenizerError, build_tokenizer

        try:
            build_tokenizer(cfg.model.tokenizer_path)
        except TokenizerError as e:
            raise ConfigError(str(e)) from None
    if t.max_norm < 0:
        raise ConfigError(f"training.max_norm must be >= 0, got {t.max_norm}")
    if t.dtype == "bfloat16" and t.mixed_precision_param not in ("auto", "bfloat16"):
        raise ConfigError(f"--training.dtype bfloat16 stores and computes in bf16: drop --training.mixed_precision_param "
                          f"{t.mixed_precision_param} (or train with --training.dtype float32)")
    if t.loss_chunk_tokens < 1:
        raise ConfigError(f"training.loss_chunk_tokens must be >= 1, got {t.loss_chunk_tokens}")
    if cfg.metrics.log_freq < 1:
        raise ConfigError(f"metrics.log_freq must be >= 1, got {cfg.metrics.log_freq}")
    prof = cfg.profiling
    outside = prof.start_step < 1 or prof.steps < 1 or prof.start_step + prof.steps - 1 > t.steps
    if (prof.enable or prof.memory_snapshot) and outside:
        raise ConfigError(
            f"profiling.start_step={prof.start_step} and profiling.steps={prof.steps} must name steps within "
            f"1..training.steps={t.steps}; e.g. --profiling.start_step {max(1, t.steps - 1)} --profiling.steps 1"
        )
    if cfg.comm.timeout_seconds < 1:
        raise ConfigError(f"comm.timeout_seconds must be >= 1, got {cfg.comm.timeout_seconds}")


def check_compile(cfg: JobConfig, device_type: str) -> None:
    from .passes.validate import check_passes

    check_passes(cfg, device_type)
    from graph_trainer.backends.autoparallel import check_config

    check_config(cfg)
    if cfg.compile.async_tp_chunks < 2:
        raise ConfigError(f"compile.async_tp_chunks must be >= 2 (slices of each rank's rows), got {cfg.compile.async_tp_chunks}")
    if cfg.profiling.memory_snapshot and device_type != "cuda":
        raise ConfigError("--profiling.memory_snapshot records the CUDA allocator: run on GPUs, or drop it")
    if cfg.compile.async_tp_lowering == "symm_mem" and (device_type != "cuda" or cfg.comm.mode == "fake"):
        raise ConfigError("--compile.async_tp_lowering symm_mem needs CUDA GPUs and real communication: use chunked (or auto)")
    if cfg.compile.compile_workers < -1:
        raise ConfigError(f"compile.compile_workers must be -1 (auto), 0 (none) or a count of processes, got {cfg.compile.compile_workers}")
    if cfg.parallelism.moe_capacity_factor < 0:
        raise ConfigError(f"parallelism.moe_capacity_factor must be >= 0 (0: never drop tokens), got {cfg.parallelism.moe_capacity_factor}")


def check_activation_checkpoint(cfg: JobConfig, degrees: tuple[int, int, int, int]) -> None:
    from .passes.memory_policy import BUDGET_FLAG, OFFLOAD_BACKENDS
    from .passes.registry import PASSES

    ac = cfg.activation_checkpoint
    if ac.memory_budget and ac.mode != "memory_budget":
        raise ConfigError(f"{BUDGET_FLAG} is read by --activation_checkpoint.mode memory_budget only; add that or drop the budget")
    if ac.mode == "memory_budget":
        modes = PASSES["memory_policy"].modes
        if cfg.compile.mode not in modes:
            raise ConfigError(
                f"--activation_checkpoint.mode memory_budget rewrites a traced train step; use --compile.mode "
                f"{' or '.join(modes)}, or --activation_checkpoint.mode full/selective with --compile.mode {cfg.compile.mode}"
            )
        parse_memory_budget(ac.memory_budget, 1.0, flag=BUDGET_FLAG)
    if ac.offload == "always" and (ac.mode != "memory_budget" or cfg.compile.mode != "aot_fx_trace"):
        raise ConfigError("--activation_checkpoint.offload always needs --activation_checkpoint.mode memory_budget with "
                          "--compile.mode aot_fx_trace; add those or drop the offload flag")
    if ac.offload == "always" and cfg.compile.inductor_compilation not in OFFLOAD_BACKENDS:
        raise ConfigError(f"--activation_checkpoint.offload always runs the step graph op by op around its transfers; use "
                          f"--compile.inductor_compilation {' or '.join(OFFLOAD_BACKENDS)}, or --activation_checkpoint.offload auto")
    if ac.offload == "always" and "cudagraph" in cfg.compile.passes:
        raise ConfigError("--activation_checkpoint.offload always allocates pinned host memory, which a CUDA graph capture "
                          "cannot: drop cudagraph from --compile.passes, or use --activation_checkpoint.offload auto")
    if ac.mode != "selective":
        return
    option = ac.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError(f"activation_checkpoint.selective_ac_option must be 'op' or an integer >= 1, got {option!r}")


def check_optimizer_schedule(cfg: JobConfig, degrees: tuple[int, int, int, int]) -> None:
    o, s = cfg.optimizer, cfg.lr_scheduler
    for name, value in (("optimizer.lr", o.lr), ("optimizer.eps", o.eps), ("optimizer.weight_decay", o.weight_decay)):
        if not value >= 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
    if s.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps must be >= 0, got {s.warmup_steps}")
    if s.decay_ratio > 1:
        raise ConfigError(f"lr_scheduler.decay_ratio must be in [0, 1] (or negative: decay after warm-up), got {s.decay_ratio}")
    if not 0 <= s.min_lr_factor <= 1:
        raise ConfigError(f"lr_scheduler.min_lr_factor must be in [0, 1], got {s.min_lr_factor}")


def check_sequence_parallel(cfg: JobConfig, degrees: tuple[int, int, int, int]) -> None:
    tp, seq_len = degrees[2], cfg.training.seq_len
    if tp > 1 and not cfg.compile.autoparallel and seq_len % tp:
        raise ConfigError(
            f"training.seq_len={seq_len} is not divisible by parallelism.tp={tp} (sequence parallelism splits "
            f"the sequence over the tp ranks); use a multiple of {tp}"
        )


def _check_writable_folder(path: Path, flag: str) -> None:
    """The folder exists or can be created: its nearest existing ancestor is a writable folder."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path} cannot be a folder: {existing} is a file; pick another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path} is not writable ({existing} denies it); pick a folder you can write to")


def check_checkpoint(cfg: JobConfig, degrees: tuple[int, int, int, int]) -> None:
    """Checkpoint flags, and the checkpoint a resume would load: complete, intact, of this model."""
    from .checkpoint import CheckpointError, check_same_model, checkpoint_root, select_checkpoint, state_shapes
    from .parallel.mesh import device_type

    c = cfg.checkpoint
    _check_writable_folder(Path(cfg.job.dump_folder), "--job.dump_folder")
    if c.interval < 1:
        raise ConfigError(f"checkpoint.interval must be >= 1, got {c.interval}")
    if c.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k must be >= 0 (0 keeps all), got {c.keep_latest_k}")
    if c.load_step < -1:
        raise ConfigError(f"checkpoint.load_step must be -1 (the latest) or a step >= 0, got {c.load_step}")
    if not c.enable:
        if c.load_step != -1 or c.fallback_to_previous:
            raise ConfigError("--checkpoint.load_step and --checkpoint.fallback_to_previous resume from a checkpoint: add --checkpoint.enable")
        return
    root = checkpoint_root(cfg)
    _check_writable_folder(root, "--checkpoint.folder")
    t = cfg.training
    try:
        chosen = select_checkpoint(root, c.load_step, c.fallback_to_previous)
        if chosen is None:
            return
        folder, meta = chosen
        spec = models.get_spec(cfg.model.name)
        model = models.build_on_meta(spec, spec.job_args(cfg), device_type())
        check_same_model(folder, meta, state_shapes(model.state_dict()), "this model")
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if meta.get("random_tokens") != t.random_tokens:
        raise ConfigError(f"checkpoint {folder} was saved with training.random_tokens={meta.get('random_tokens')}; resume with the same setting")
    if not t.random_tokens and meta.get("seq_len") != t.seq_len:
        raise ConfigError(
            f"checkpoint {folder} counts its data position in samples of seq_len {meta.get('seq_len')}; "
            f"resume with --training.seq_len {meta.get('seq_len')}"
        )


_CHECKS_AFTER_MESH = (check_model, check_training, check_activation_checkpoint, check_optimizer_schedule, check_sequence_parallel, check_checkpoint)


def validate(cfg: JobConfig, world_size: int | None = None, device_type: str | None = None) -> tuple[int, int, int, int]:
    """Raise ConfigError for the first problem found; return the resolved mesh degrees. The checks
    see the configuration the job will run: its `auto` settings resolved (defaults.py)."""
    from .parallel.mesh import device_type as detect_device

    check_comm(cfg)
    if world_size is None:
        world_size = cfg.comm.fake_world_size if cfg.comm.mode == "fake" else world_size_from_env()
    device_type = device_type or detect_device()
    degrees = check_mesh(cfg, world_size)
    cfg = resolve(cfg, device_type, world_size)
    for check in _CHECKS_AFTER_MESH:
        check(cfg, degrees)
    check_compile(cfg, device_type)
    return degrees


def check_autoparallel(cfg: JobConfig, degrees: tuple[int, int, int, int]) -> None:
    c = cfg.compile
    if c.autoparallel_plan and not c.autoparallel:
        raise ConfigError("compile.autoparallel_plan needs --compile.autoparallel (the plan replaces the manual placement)")
    if not c.autoparallel:
        return
    if c.inductor_compilation == "regional":
        # Auto-placed blocks run as interpreters of their traced ops, so the module marks that regional Inductor compiles never reach the graph.
        raise ConfigError("--compile.autoparallel leaves no region marked for --compile.inductor_compilation regional: "
                          "use --compile.inductor_compilation full (or none), or drop --compile.autoparallel")
    if c.autoparallel_impl == "meta":
        from .autoparallel.meta_adapter import require

        require()
        if models.get_spec(cfg.model.name).is_moe:
            raise ConfigError(f"--compile.autoparallel_impl meta places dense models only here; use --compile.autoparallel_impl builtin for {cfg.model.name}")
        if getattr(models.get_spec(cfg.model.name).job_args(cfg), "attn_type", "sdpa") == "flex":
            # the BlockMask the model builds from its tokens is handed to blocks only by the built-in solver (autoparallel/flex.py)
            raise ConfigError(f"--compile.autoparallel_impl meta places SDPA models only here ({cfg.model.flavor} uses FlexAttention): "
                              "add --model.attention sdpa, or use --compile.autoparallel_impl builtin")
        if c.autoparallel_plan:
            raise ConfigError("compile.autoparallel_plan holds a plan of the built-in solver; drop it or use --compile.autoparallel_impl builtin")
        ac = cfg.activation_checkpoint.mode
        if ac in ("full", "selective"):
            # Meta's placed module runs its own forward graph: the per-block checkpoint wrappers are never called
            # (the 8B dp8 run with selective AC kept every activation: 53.0 GiB, 1.11x the manual step)
            raise ConfigError(f"--activation_checkpoint.mode {ac} never reaches the forward graph Meta's placer runs: use "
                              "--activation_checkpoint.mode memory_budget (decided on the traced step) or none, or "
                              "--compile.autoparallel_impl builtin")
    from .autoparallel.entry import EP_DIM, check_plan_file

    ep, dp_shard = degrees[3], degrees[1]
    if ep > 1 and ep != dp_shard:
        raise ConfigError(
            f"with --compile.autoparallel, --parallelism.ep pins expert parallelism over {EP_DIM}, so it must be 1 (the solver "
            f"chooses) or {EP_DIM}'s degree {dp_shard}, not {ep}"
        )
    parse_memory_budget(c.autoparallel_memory_budget, 1.0)
    if c.autoparallel_plan:
        check_plan_file(c.autoparallel_plan, cfg, degrees)


def check_initial_load_and_writers(cfg: JobConfig, degrees: tuple[int, int, int, int]) -> None:
    """--checkpoint.initial_load_path (an HF checkpoint of this architecture and size, or one of our DCP
    step folders of this model), --checkpoint.last_save_in_hf and --metrics.enable_wandb."""
    from .checkpoint import CheckpointError, checkpoint_root
    from .hf_checkpoint import check_dcp_folder, check_hf_folder
    from .metrics_writers import wandb_missing
    from .parallel.mesh import device_type

    c = cfg.checkpoint
    if cfg.metrics.enable_wandb and wandb_missing():
        raise ConfigError("--metrics.enable_wandb needs the wandb package, which is not installed: pip install wandb, or drop the flag")
    if c.last_save_in_hf:
        _check_writable_folder(checkpoint_root(cfg), "--checkpoint.folder")
    if not c.initial_load_path:
        if c.initial_load_in_hf:
            raise ConfigError("--checkpoint.initial_load_in_hf says how to read --checkpoint.initial_load_path: give that folder too")
        return
    spec = models.get_spec(cfg.model.name)
    args = spec.job_args(cfg)
    model = models.build_on_meta(spec, args, device_type())
    what = f"{cfg.model.name} {cfg.model.flavor}" + (f" with {cfg.model.n_layers} layers" if cfg.model.n_layers else "")
    folder = Path(c.initial_load_path)
    if not folder.is_dir():
        what_folder = "a Hugging Face checkpoint folder" if c.initial_load_in_hf else "a step folder a save wrote (e.g. outputs/checkpoint/step-20)"
        raise ConfigError(f"--checkpoint.initial_load_path {folder} is not a folder; pass {what_folder}")
    try:
        if c.initial_load_in_hf:
            check_hf_folder(folder, spec, model, args, what)
        else:
            check_dcp_folder(folder, model, what)
    except CheckpointError as e:
        if c.initial_load_in_hf:
            hint = ""
        elif (folder / "config.json").is_file():
            hint = " (a Hugging Face folder: add --checkpoint.initial_load_in_hf)"
        else:
            hint = "; pass a step folder a finished save wrote (e.g. outputs/checkpoint/step-20)"
        raise ConfigError(f"{e}{hint}") from None


_CHECKS_AFTER_MESH += (check_initial_load_and_writers,)


def check_validation(cfg: JobConfig, degrees: tuple[int, int, int, int]) -> None:
    """--validation.*: where its data comes from, and how often and how much it evaluates."""
    v = cfg.validation
    for name in ("freq", "steps"):
        if getattr(v, name) < 1:
            raise ConfigError(f"validation.{name} must be >= 1, got {getattr(v, name)}")
    if not 0 <= v.split < 1:
        raise ConfigError(f"validation.split is the share of the training documents held out, in [0, 1); got {v.split}")
    if v.split and v.dataset_path:
        raise ConfigError("--validation.split holds out training documents, --validation.dataset_path names other data: give one of them")
    if v.split and cfg.training.random_tokens:
        raise ConfigError("--validation.split holds out documents of the training data, and --training.random_tokens reads none: "
                          "drop one of them (random tokens can validate on --validation.dataset_path)")
    if v.dataset_path and not v.enable:
        raise ConfigError("--validation.dataset_path is read by --validation.enable only: add it, or drop the path")
    if v.enable and not (v.dataset_path or v.split):
        raise ConfigError("--validation.enable needs data the model does not train on: --validation.dataset_path FILE, "
                          "or --validation.split 0.1 to hold out a share of the training documents")
    if v.dataset_path:
        check_data_path(v.dataset_path, "--validation.dataset_path")


_CHECKS_AFTER_MESH += (check_validation,)


def _stage_graph_has_dtensors(cfg: JobConfig, degrees: tuple[int, int, int, int]) -> bool:
    """Whether a traced pipeline stage reads DTensor parameters: unless `pp_gather step` hands it plain gathered
    copies of every parameter, which it does for FSDP over more than one rank without TP, EP or the solver."""
    dp_replicate, dp_shard, tp, ep = degrees
    return not (dp_replicate * dp_shard > 1 and cfg.parallelism.pp_gather == "step" and tp == ep == 1 and not cfg.compile.autoparallel)


def check_pipeline(cfg: JobConfig, degrees: tuple[int, int, int, int]) -> None:
    """--parallelism.pp: the stage split, the schedule's microbatches, and what pipelining does not combine with."""
    from .parallel.pipeline import BALANCED, LOOPED, SPLIT_BACKWARD, microbatches_of, min_microbatches, split_layers, stages_per_rank
    from .passes.registry import PASSES
    from .passes.validate import turning_off
    from .pipelining import TRACED_MODES

    p, t = cfg.parallelism, cfg.training
    if p.pp == 1:
        if p.pp_layers_per_stage or p.pp_microbatches or p.pp_stages_per_rank or p.pp_gather != "step":
            raise ConfigError("--parallelism.pp_layers_per_stage/pp_microbatches/pp_stages_per_rank/pp_gather shape a pipeline: "
                              "add --parallelism.pp N (N > 1)")
        return
    whole_step_only = [n for n in cfg.compile.passes if n in PASSES and not {"joint", "forward", "backward"} & set(PASSES[n].stages)]
    unsupported = [
        (cfg.compile.autoparallel and cfg.compile.autoparallel_impl == "meta",
         "--compile.autoparallel_impl meta (Meta's AutoParallel places whole-model graphs; the built-in solver places stages)"),
        (cfg.compile.mode == "jit", "--compile.mode jit"),
        (cfg.compile.optimizer_in_graph,
         f"--compile.optimizer_in_graph (which the production configs set: {turning_off('compile.optimizer_in_graph', True)})"),
        (t.loss == "fused_linear_ce", "--training.loss fused_linear_ce (the output projection is in the last stage's graph)"),
        (cfg.validation.enable, "--validation.enable"),
        (cfg.checkpoint.last_save_in_hf, "--checkpoint.last_save_in_hf (save a checkpoint and run `graph-trainer export` on it)"),
        (cfg.compile.mode in TRACED_MODES and p.pp_schedule in SPLIT_BACKWARD and _stage_graph_has_dtensors(cfg, degrees),
         f"--parallelism.pp_schedule {p.pp_schedule} with --compile.mode {cfg.compile.mode} here (a traced stage's backward splits into "
         "input and weight gradients where its parameters are plain tensors: FSDP over 2 or more ranks, gathered once per step, "
         "without tp, ep or --compile.autoparallel; use --compile.mode eager or another schedule)"),
        (cfg.compile.mode in TRACED_MODES and bool(whole_step_only),
         f"--compile.passes {','.join(whole_step_only)} (whole-step graphs only; a traced stage's joint, forward and backward graphs take "
         "the passes that declare those, as aot does: e.g. auto_bucketing)"),
        (cfg.compile.mode == "eager" and p.pp_schedule in SPLIT_BACKWARD and degrees[0] * degrees[1] > 1 and p.pp_gather == "step",
         f"--parallelism.pp_schedule {p.pp_schedule} in eager with --parallelism.pp_gather step (torch's weight-gradient pass sets the "
         "gathered copies' gradients without the hooks that reduce them; use --parallelism.pp_gather microbatch)"),
    ]
    for hit, what in unsupported:
        if hit:
            raise ConfigError(f"--parallelism.pp {p.pp} does not combine with {what} yet; drop one of them")
    if p.pp_stages_per_rank < 0:
        raise ConfigError(f"parallelism.pp_stages_per_rank must be >= 0 (0: the schedule's default), got {p.pp_stages_per_rank}")
    per_rank = stages_per_rank(p.pp_schedule, p.pp_stages_per_rank)
    if p.pp_schedule in LOOPED and per_rank < 2:
        raise ConfigError(f"--parallelism.pp_schedule {p.pp_schedule} runs several stages per rank: set --parallelism.pp_stages_per_rank >= 2")
    if p.pp_schedule not in LOOPED and per_rank != 1:
        raise ConfigError(f"--parallelism.pp_schedule {p.pp_schedule} runs one stage per rank: drop --parallelism.pp_stages_per_rank, "
                          f"or use Interleaved1F1B for {per_rank}")
    balanced = p.pp_layers_per_stage == [BALANCED]
    if not (balanced or all(n.isdigit() for n in p.pp_layers_per_stage)):
        raise ConfigError(f"--parallelism.pp_layers_per_stage takes layer counts (e.g. 1,3) or {BALANCED}, got {','.join(p.pp_layers_per_stage)}")
    if not balanced:
        n_layers = models.get_spec(cfg.model.name).job_args(cfg).n_layers
        try:
            split_layers(n_layers, p.pp * per_rank, [int(n) for n in p.pp_layers_per_stage])
        except ValueError as e:
            raise ConfigError(f"--parallelism.pp {p.pp}: {e}") from None
    if p.pp_microbatches < 0:
        raise ConfigError(f"parallelism.pp_microbatches must be >= 0 (0: one per stage), got {p.pp_microbatches}")
    micro = microbatches_of(p)
    least = min_microbatches(p.pp_schedule, p.pp)
    if micro < least:
        raise ConfigError(f"--parallelism.pp_schedule {p.pp_schedule} needs at least {least} microbatches (one per pp rank), "
                          f"got --parallelism.pp_microbatches {micro}; raise it or use GPipe")
    per_rank_batch = t.batch_size // (degrees[0] * degrees[1] * t.gradient_accumulation_steps)
    if per_rank_batch % micro:
        raise ConfigError(f"each data-parallel rank's batch of {per_rank_batch} sequences (per accumulation step) does not split into "
                          f"{micro} pipeline microbatches; use a --training.batch_size that is a multiple of "
                          f"{degrees[0] * degrees[1] * t.gradient_accumulation_steps * micro}, or another --parallelism.pp_microbatches")


# the plan file is held against the pipeline's stages, which check_pipeline makes sure exist
_CHECKS_AFTER_MESH += (check_pipeline, check_autoparallel)


def check_embedding(cfg: JobConfig, degrees: tuple[int, int, int, int]) -> None:
    """`--parallelism.embedding vocab` where the job can read its embedding in place (parallel/vocab_embedding.py)."""
    if cfg.parallelism.embedding != "vocab":
        return
    from .parallel.mesh import Degrees
    from .parallel.vocab_embedding import unsupported

    vocab = models.get_spec(cfg.model.name).job_args(cfg).vocab_size
    why = unsupported(Degrees(*degrees), vocab, cfg.compile.autoparallel)
    if why:
        raise ConfigError(f"--parallelism.embedding vocab cannot run here: {why}; use --parallelism.embedding gather (or auto)")


_CHECKS_AFTER_MESH += (check_embedding,)
