"""`graph-trainer precompile`: fill a job's compile cache (compile_cache.py) from one process, so that
every rank of the job then starts by loading its compiled step instead of compiling it.

It takes the job's own flags and runs it on torch's fake process group (`--comm.mode fake`, world
size from the job's degrees): the trainer is built as the job builds it, and one microbatch goes
through the step, which captures, runs the passes and compiles it (every capture mode compiles at
its first call); no optimizer step, checkpoint or metric follows. The graph is the one the real job
traces: same shapes, same passes (they are resolved for the job's world size), same collective
group names (checked against a 2-rank gloo run: group '0' in both on a one-dimensional mesh).

Which ranks: on a mesh with one dimension larger than 1, every rank's graph is rank 0's (the same
groups, the same shard shapes), so rank 0 stands for all; with pipelining, the first rank of each
pipeline rank stands for its data-parallel ranks (each holds other stages). With more such dimensions each rank sits
in groups of its own, whose names are in its graph, so every rank is compiled (Inductor's kernel
cache makes the ranks after the first cheaper, not free); that the fake group names a rank's groups as
a real job does is checked on one dimension only.

On GPUs two things limit what a precompiled entry serves (the job compiles and stores the rest at
its first start; every later start loads): the compiled code pins its device (cuda:0 for a simulated
rank, cuda:LOCAL_RANK in the job), so only local rank 0 can use it; and a multi-rank job plans its
overlap schedule with the link figures it probes at start-up, which a fake process group cannot
measure, so pieces whose prefetch the plan changes differ (measured: llama3 1B, dp_shard 2 on 2
H100s: 3 of 10 pieces loaded on rank 0).
"""

from __future__ import annotations

import dataclasses
import logging

import torch.distributed as dist

from .config import CACHED_BACKENDS, ConfigError, JobConfig, cache_folder
from .defaults import resolve
from .parallel.fake_data import restore_collectives
from .parallel.mesh import device_type
from .passes.registry import run_teardowns

logger = logging.getLogger("graph_trainer")


def job_world_size(cfg: JobConfig) -> int:
    """The job's rank count: `--comm.fake_world_size` when given, else the product of its degrees."""
    if cfg.comm.mode == "fake":
        return cfg.comm.fake_world_size
    p = cfg.parallelism
    if p.dp_shard == -1:
        raise ConfigError("precompile needs the job's world size: give --parallelism.dp_shard explicitly, "
                          "or --comm.mode fake --comm.fake_world_size N")
    return p.dp_replicate * p.dp_shard * p.tp * p.pp


def ranks_to_compile(cfg: JobConfig, world_size: int) -> list[int]:
    """The ranks whose graphs stand for every rank's (see the module docstring): with pipelining, those of
    each pipeline rank, whose stages differ (pp is the outermost mesh dimension)."""
    p = cfg.parallelism
    per_stage = world_size // p.pp
    dp_shard = per_stage // (p.dp_replicate * p.tp) if p.dp_shard == -1 else p.dp_shard
    split = [d for d in (p.dp_replicate, dp_shard, p.tp, p.ep) if d > 1]
    dense = [0] if len(split) <= 1 else list(range(per_stage))
    return [pp_rank * per_stage + r for pp_rank in range(p.pp) for r in dense]


def fake_job(cfg: JobConfig, world_size: int, rank: int) -> JobConfig:
    """`cfg` as one simulated rank of the job: fake communication, nothing saved."""
    comm = dataclasses.replace(cfg.comm, mode="fake", fake_world_size=world_size, fake_rank=rank)
    return dataclasses.replace(cfg, comm=comm, checkpoint=dataclasses.replace(cfg.checkpoint, enable=False))


def check(cfg: JobConfig) -> int:
    """Raise ConfigError when there is nothing precompile could store; return the job's world size."""
    world_size = job_world_size(cfg)
    if cache_folder(cfg) is None:
        raise ConfigError("precompile fills the compile cache, which --compile.cache_dir turns off: give it a folder (or auto)")
    backend = resolve(cfg, device_type(), world_size).compile.inductor_compilation
    if backend not in CACHED_BACKENDS:
        raise ConfigError(f"precompile stores full Inductor compiles; --compile.inductor_compilation {backend} makes none: "
                          "use --compile.inductor_compilation full (or autoparallel_backend)")
    return world_size


def precompile(cfg: JobConfig, world_size: int) -> dict[int, str]:
    """Compile (or find cached) the step of each rank `ranks_to_compile` names; return each one's
    `compile_cache` outcome."""
    from .trainer import GraphTrainer

    outcomes = {}
    for rank in ranks_to_compile(cfg, world_size):
        try:
            trainer = GraphTrainer(fake_job(cfg, world_size, rank))
            # with pipelining, one schedule step: every local stage's forward and backward graphs compile
            trainer.step_fn(*trainer.next_batches(0))
            outcomes[rank] = trainer.capture.stats.get("compile_cache", "not reported")
        finally:
            run_teardowns()
            restore_collectives()
            if dist.is_initialized():
                dist.destroy_process_group()
        logger.info(f"precompile: rank {rank} of {world_size}: {outcomes[rank]}")
    return outcomes
