"""The settings left to `auto`, resolved for the device and rank count a job runs on: one place, so
the validator checks, the trainer runs and `config.toml` records the same configuration.

- `--compile.inductor_compilation auto`: `full` on GPUs in the graph modes (the measured-best
  backend: whole-step Inductor), `none` in eager and on CPU, where the traced step runs as FX, bitwise equal to eager, without
  Inductor's C++ compile at every start.
- `--compile.passes` left empty in a multi-rank aot_fx_trace job whose parameters are sharded: the
  overlap schedule, `separate_gather_group` (all-gathers on their own communicator) then
  `transformer_block_bucketing` (one bucket per block, prefetch chosen by the cost model); with
  `autoparallel_backend`, whose own scheduling pass buckets, only the first; on GPUs with tp > 1,
  then `async_tp` (1.04x over the step without it at llama3 8B-16L tp 2 on 2 H200s:
  bench/results/2026-11-29-session21) and `tp_reduce_overlap` (the reduce-scatters async_tp leaves no longer
  exposed there, 0.4 ms against 5.8-11.5, 1.03x in one call: bench/results/2026-11-30-session28). `--compile.passes none` runs the step without any pass of
  ours; any other list is taken as it is. With pipeline parallelism the default is no pass.
"""

from __future__ import annotations

import dataclasses

from .config import JobConfig

OVERLAP_SCHEDULE = ("separate_gather_group", "transformer_block_bucketing")
NO_PASSES = "none"


def resolved_backend(cfg: JobConfig, device_type: str) -> str:
    """`--compile.inductor_compilation` with `auto` decided for the device."""
    if cfg.compile.inductor_compilation != "auto":
        return cfg.compile.inductor_compilation
    # eager captures no graph for a backend to compile
    return "full" if device_type == "cuda" and cfg.compile.mode != "eager" else "none"


def _sharded(cfg: JobConfig, world_size: int) -> bool:
    """Whether parameters are sharded over data-parallel ranks (FSDP all-gathers to schedule)."""
    # imported here: the rest of this module is read before torch is (worker_processes.start_early)
    from .parallel.mesh import resolve_degrees

    p = cfg.parallelism
    return world_size > 1 and resolve_degrees(p.dp_replicate, p.dp_shard, p.tp, p.ep, world_size, p.pp).dp_shard > 1


def _passes(cfg: JobConfig, backend: str, world_size: int, device_type: str) -> list[str]:
    passes = list(cfg.compile.passes)
    if passes == [NO_PASSES]:
        return []
    # the overlap schedule plans over a whole-step graph; pipeline stages are graphs of part of a step
    if passes or cfg.compile.mode != "aot_fx_trace" or cfg.parallelism.pp > 1:
        return passes
    schedule = OVERLAP_SCHEDULE[:1] if backend == "autoparallel_backend" else OVERLAP_SCHEDULE
    # symmetric memory's fused ops need real CUDA peers; elsewhere the chunked lowering only adds copies (gloo's
    # collectives do not run beside the matmuls; fake ones move nothing)
    real_gpus = device_type == "cuda" and cfg.comm.mode == "real"
    tp = ["async_tp", "tp_reduce_overlap"] if real_gpus and world_size > 1 and cfg.parallelism.tp > 1 else []
    return [*(schedule if _sharded(cfg, world_size) else ()), *tp]


def resolve(cfg: JobConfig, device_type: str, world_size: int) -> JobConfig:
    """A copy of `cfg` with every `auto` setting decided. Run once per job: an empty pass list
    resolves to the schedule, so a resolved `none` is recorded as such (`for_record`)."""
    backend = resolved_backend(cfg, device_type)
    compile_ = dataclasses.replace(cfg.compile, inductor_compilation=backend,
                                   passes=_passes(cfg, backend, world_size, device_type))
    return dataclasses.replace(cfg, compile=compile_)


def for_record(cfg: JobConfig) -> JobConfig:
    """The resolved config as `config.toml` keeps it: a job without passes says `none`, so that the
    file given back with --config runs the same passes."""
    if cfg.compile.passes:
        return cfg
    return dataclasses.replace(cfg, compile=dataclasses.replace(cfg.compile, passes=[NO_PASSES]))
