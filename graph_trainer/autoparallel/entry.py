"""What the CLI and the trainer call: settings from the config, solve or load a plan, place a model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import ConfigError, JobConfig
from ..parallel.pipeline import PipelineLayout, layout_of, prune_to_rank, stage_views
from ..parallel.simple_fsdp import MixedPrecision
from ..hardware import Hardware, select
from ..units import GiB, parse_memory_budget
from . import report
from .memory import ActivationPolicy
from .moe import prepare_model
from .planner import MeshInfo, Settings, plan_model

PLAN_VERSION = 1
EP_DIM = "dp_shard"
"""`--parallelism.ep N` with the solver pins expert parallelism to this mesh dim (N must be its size)."""


PLAN_MEMORY_RESERVE = 8 * GiB
"""What the built-in solver's default budget leaves free of the device memory: the budget is device
memory minus this. The plan's memory row counts parameters, gradients, optimizer state, the
activations the AC policy keeps, MoE dispatch buffers and gathered parameters, all at once (gradients
beside every activation: more than is ever alive together), and it came out at or above the peak
active bytes of every auto-placed GPU run measured (`graph-trainer plan` of the bench's jobs against
their peaks in bench/results/2026-11-24-scale.md: 8B dp8 46.5 GiB against 35.7, 8B dp4 x tp2 30.8
against 28.4, DeepSeek V3 16B dp8 x ep8 127.4 against 122.0). What it leaves out is memory that is not
the allocator's active bytes: 2 GiB for what lives outside the allocator (the CUDA context,
cuBLAS/cuDNN handles, NCCL's communicator buffers) and 6 GiB for the allocator's reserved-but-inactive
blocks at the peak (fragmentation; torchtitan's peak reserved memory of identical runs differed by
3.9 GiB, NOTES.md). A fixed reserve, not a share of the device: none of these grows with the device's
size (0.85 of the H200 refused the DeepSeek run, which fits)."""


def mesh_info(degrees: Any) -> MeshInfo:
    names = ("dp_replicate", "dp_shard", "tp")
    shape = (degrees[0], degrees[1], degrees[2])
    return MeshInfo(names, shape, tuple(i for i, s in enumerate(shape) if s > 1))


def param_dtype_for(cfg: JobConfig, device_type: str) -> torch.dtype:
    return MixedPrecision.from_config(cfg.training, device_type).param_dtype


def model_identity(cfg: JobConfig, args: Any) -> dict[str, Any]:
    from ..models import describe

    return {"name": cfg.model.name, "flavor": cfg.model.flavor, "arch": describe(args)}


def traced_batch(cfg: JobConfig, layout: PipelineLayout | None = None) -> tuple[int, int]:
    """The global (batch, seq) one call of the model (or of a pipeline stage) sees: a gradient-accumulation
    microbatch, split again into the pipeline schedule's microbatches."""
    t = cfg.training
    return (t.batch_size // t.gradient_accumulation_steps // (layout.microbatches if layout else 1), t.seq_len)


def solve(cfg: JobConfig, model: nn.Module, args: Any, info: MeshInfo, solver_mesh: DeviceMesh | None,
          device: torch.device, param_dtype: torch.dtype, hw: Hardware, layout: PipelineLayout | None = None,
          activations: int = 0) -> dict[str, Any]:
    """Trace on `device` and solve, priced on `hw` (the job's devices, which `graph-trainer plan` does not have).
    With `layout`, `model` is one pipeline stage, taking `activations`-wide input (0: token ids)."""
    batch = traced_batch(cfg, layout)
    settings = solver_settings(cfg, model, hw)
    if layout is not None:
        # the step runs the stage once per schedule microbatch (the memory row still counts one microbatch's
        # activations, where 1F1B keeps up to pp microbatches' in flight on the first stage)
        settings = dataclasses.replace(settings, microbatches=settings.microbatches * layout.microbatches)
    plan = plan_model(model, batch, param_dtype, device, info, solver_mesh, settings, activations).data
    plan["model"] = model_identity(cfg, args)
    plan["batch"] = {"global_microbatch": list(batch), "param_dtype": str(param_dtype).removeprefix("torch.")}
    return plan


def _stage_of(model: nn.Module, layout: PipelineLayout, stage: int) -> nn.Module:
    """Stage `stage` of a whole meta-device model, as its pipeline rank holds it (the model is pruned in place)."""
    pp_rank = stage % layout.pp
    prune_to_rank(model, layout, pp_rank)
    return stage_views(model, layout, pp_rank)[layout.stages_of(pp_rank).index(stage)]


def solve_stages(cfg: JobConfig, args: Any, layout: PipelineLayout, build: Callable[[], nn.Module], info: MeshInfo,
                 solver_mesh: DeviceMesh | None, device: torch.device, param_dtype: torch.dtype, hw: Hardware) -> dict[str, Any]:
    """A pipeline job's plan: every stage solved apart, on its own graph (`build()` gives a whole meta-device
    model to cut it from) over the mesh of one pipeline rank, for one schedule microbatch. A stage's input and
    output are laid out like the token batch, as the schedule sends them between ranks: the first stage takes
    the tokens, the others the previous stage's activations (trace.Source `activations`)."""
    stages = []
    for s in range(layout.num_stages):
        stage = _stage_of(build(), layout, s)
        prepare_model(stage)
        stages.append(solve(cfg, stage, args, info, solver_mesh, device, param_dtype, hw, layout, args.dim if s else 0))
    return {"version": PLAN_VERSION, "model": model_identity(cfg, args), "mesh": stages[0]["mesh"],
            "pipeline": pipeline_identity(layout), "stages": stages}


def pipeline_identity(layout: PipelineLayout) -> dict[str, Any]:
    return {"pp": layout.pp, "schedule": layout.schedule, "microbatches": layout.microbatches, "layers": [list(s) for s in layout.layers]}


def solver_settings(cfg: JobConfig, model: nn.Module, hw: Hardware) -> Settings:
    """What the built-in solver prices a plan of this job with (also for pricing another solver's plan):
    `hw` is `hardware.select` of the job's device, and the memory row counts the activations the job's
    activation checkpointing keeps."""
    t = cfg.training
    ac = cfg.activation_checkpoint
    return Settings(
        hw=hw,
        memory_budget=(parse_memory_budget(cfg.compile.autoparallel_memory_budget, hw.device_memory_bytes)
                       if cfg.compile.autoparallel_memory_budget.strip() else hw.device_memory_bytes - PLAN_MEMORY_RESERVE),
        reduce_dtype=MixedPrecision.from_config(t, "cuda").reduce_dtype,
        param_itemsize=next(model.parameters()).element_size(),
        microbatches=t.gradient_accumulation_steps,
        moe_capacity_factor=cfg.parallelism.moe_capacity_factor,
        expert_parallel_dim=EP_DIM if cfg.parallelism.ep > 1 else None,
        activations=ActivationPolicy.of(ac.mode, ac.selective_ac_option),
    )


def check_plan_file(path: str, cfg: JobConfig, degrees: Any) -> dict[str, Any]:
    """Read a plan.json and refuse one made for another model or mesh (before any process group)."""
    from .. import models

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"compile.autoparallel_plan {path} does not exist; write one with `graph-trainer plan`")
    try:
        plan = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"compile.autoparallel_plan {path} is not valid JSON ({e}); write it again with `graph-trainer plan`") from None
    if not isinstance(plan, dict) or plan.get("version") != PLAN_VERSION or "model" not in plan or "mesh" not in plan:
        raise ConfigError(f"compile.autoparallel_plan {path} is not a graph-trainer plan (version {PLAN_VERSION}); write one with `graph-trainer plan`")
    spec = models.get_spec(cfg.model.name)
    args = spec.job_args(cfg)
    ours = model_identity(cfg, args)
    theirs = plan["model"]
    if (theirs.get("name"), theirs.get("flavor"), theirs.get("arch")) != (ours["name"], ours["flavor"], ours["arch"]):
        raise ConfigError(
            f"compile.autoparallel_plan {path} was made for model {theirs.get('name')} {theirs.get('flavor')} "
            f"(or other layer/shape settings), not {ours['name']} {ours['flavor']}; run `graph-trainer plan` for this model"
        )
    shape = list(mesh_info(degrees).shape)
    if plan["mesh"].get("shape") != shape:
        raise ConfigError(
            f"compile.autoparallel_plan {path} was made for mesh (dp_replicate, dp_shard, tp) = {tuple(plan['mesh'].get('shape', []))}, "
            f"not {tuple(shape)}; run `graph-trainer plan` with these --parallelism degrees"
        )
    made, want = plan.get("pipeline"), _pipeline_of(cfg, spec, args)
    if made != want:
        raise ConfigError(f"compile.autoparallel_plan {path} was made for {_pipeline_words(made)}, not {_pipeline_words(want)}; "
                          "run `graph-trainer plan` with these --parallelism flags")
    ep = cfg.parallelism.ep
    unpinned = [name for stage in plan.get("stages", [plan]) for name, m in stage.get("moe", {}).items()
                if (m["expert_parallel"] or {}).get("degree", 1) != ep]
    if ep > 1 and unpinned:
        raise ConfigError(
            f"compile.autoparallel_plan {path} does not split the routed experts of {unpinned[0]} over {EP_DIM} as "
            f"--parallelism.ep {ep} pins; run `graph-trainer plan` with --parallelism.ep {ep}, or train with --parallelism.ep 1"
        )
    return plan


def _pipeline_of(cfg: JobConfig, spec: Any, args: Any) -> dict[str, Any] | None:
    """The pipeline identity (`pipeline_identity`) of the job's flags; None without pipelining."""
    from .. import models

    layout = layout_of(cfg.parallelism, args.n_layers,
                       lambda: models.stage_costs(args, models.build_on_meta(spec, args, "cpu"), cfg.training.seq_len))
    return None if layout is None else pipeline_identity(layout)


def _pipeline_words(pipeline: dict[str, Any] | None) -> str:
    if pipeline is None:
        return "no pipeline (--parallelism.pp 1)"
    return (f"--parallelism.pp {pipeline['pp']} {pipeline['schedule']}, {pipeline['microbatches']} microbatches, stage layer counts "
            + ",".join(str(len(s)) for s in pipeline["layers"]))


def place(model: nn.Module, spec: Any, args: Any, meshes: Any, mp: Any, cfg: JobConfig, layout: PipelineLayout | None = None,
          build: Callable[[], nn.Module] | None = None) -> nn.Module:
    """The trainer's entry: solve (rank 0, broadcast) or load the plan, then apply it; or let Meta's
    AutoParallel do both (`--compile.autoparallel_impl meta`). With pipelining (`layout`), `model` holds this
    pipeline rank's stages and each is placed by its stage's plan; rank 0 solves every stage, on models
    `build()` gives (whole, on the meta device, ready to trace)."""
    degrees = meshes.degrees
    info = mesh_info((degrees.dp_replicate, degrees.dp_shard, degrees.tp, degrees.ep))
    batch = traced_batch(cfg, layout)
    device = meshes.dense.device_type
    device = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    hw = select(cfg.compile.hardware, device)
    if cfg.compile.autoparallel_impl == "meta":
        from .meta_adapter import place as meta_place

        # half: Meta's memory row counts parameters only, the rest is for activations
        budget = parse_memory_budget(cfg.compile.autoparallel_memory_budget, hw.device_memory_bytes)
        # one GPU: a 1-D mesh of size 1 (on the 3-D one, Meta's program would weigh every layout on every dim)
        return meta_place(model, batch, meshes.dense[info.solver_names or ("dp_shard",)], mp, budget,
                          exported=cfg.compile.mode == "aot")

    from ..parallel.compat import from_lead
    from .apply import apply_plan
    from .compat import register_cpu_attention_strategies
    from .trace import trace_model

    register_cpu_attention_strategies()
    prepare_model(model)
    if cfg.compile.autoparallel_plan:
        plan = check_plan_file(cfg.compile.autoparallel_plan, cfg, (degrees.dp_replicate, degrees.dp_shard, degrees.tp))
    else:
        def solved() -> dict:
            solver_mesh = meshes.dense[info.solver_names] if info.solver_names else None
            if layout is None:
                found = solve(cfg, model, args, info, solver_mesh, device, mp.param_dtype, hw)
            else:
                assert build is not None, "rank 0 solves every pipeline stage on models of its own"
                found = solve_stages(cfg, args, layout, build, info, solver_mesh, device, mp.param_dtype, hw)
            # beside metrics.jsonl, so that a run's predicted step can be held against its measured one
            report.write(found, cfg.job.dump_folder)
            return found

        plan = from_lead(solved)
    if layout is None:
        trace = trace_model(model, batch, mp.param_dtype, device)
        return apply_plan(model, plan, trace, meshes.dense, mp, cfg.parallelism.moe_capacity_factor)
    pp_rank = meshes.pp.get_local_rank()
    last = layout.num_stages - 1
    for stage, index in zip(stage_views(model, layout, pp_rank), layout.stages_of(pp_rank)):
        trace = trace_model(stage, batch, mp.param_dtype, device, args.dim if index else 0)
        apply_plan(stage, plan["stages"][index], trace, meshes.dense, mp, cfg.parallelism.moe_capacity_factor, loss_follows=index == last)
    return model
