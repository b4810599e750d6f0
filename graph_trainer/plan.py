"""`graph-trainer plan`: solve the placement of a model on a mesh without GPUs, print it, save plan.json;
with `--against meta` also solve it with Meta's AutoParallel and compare (autoparallel/plan_compare.py).

The mesh is simulated by a fake process group of the mesh's size in this one process (no memory,
no communication); the model lives on the meta device and is traced on fake tensors. Costs are
those of the GPU run the plan is for (`--compile.hardware`; `auto` is the H100 where there is no GPU,
bf16 compute unless the config says otherwise).
"""

from __future__ import annotations

import functools
import math
from typing import Any

from .config import ConfigError, JobConfig, parse_args


def make_plan(cfg: JobConfig) -> dict[str, Any]:
    """Solve on a fake process group standing for the mesh; returns the plan (what plan.json holds)."""
    p = cfg.parallelism
    if p.dp_shard == -1:
        raise ConfigError("graph-trainer plan needs the mesh spelled out: pass --parallelism.dp_shard N (and tp, dp_replicate)")
    if cfg.compile.autoparallel_impl != "builtin":
        raise ConfigError("graph-trainer plan shows the built-in solver's plan; drop --compile.autoparallel_impl meta "
                          "(to set Meta's plan beside it: --against meta)")
    cfg.compile.autoparallel = True
    cfg.compile.autoparallel_plan = ""
    from .validate import validate

    degrees = validate(cfg, world_size=p.dp_replicate * p.dp_shard * p.tp * p.pp, device_type="cuda")

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from . import models
    from .autoparallel import compat
    from .autoparallel.entry import mesh_info, param_dtype_for, solve, solve_stages
    from .autoparallel.moe import prepare_model
    from .data.tokenizer import separator_of
    from .hardware import select
    from .parallel.compat import init_fake_process_group
    from .parallel.pipeline import layout_of

    info = mesh_info(degrees)
    init_fake_process_group(math.prod(info.shape))
    compat.register_cpu_attention_strategies()
    solver_mesh = init_device_mesh("cpu", info.sizes, mesh_dim_names=info.solver_names) if info.sizes else None
    spec = models.get_spec(cfg.model.name)
    args = spec.job_args(cfg)
    build = functools.partial(models.build_to_place, spec, args, "cpu", separator_of(cfg.model.tokenizer_path), models.stored_dtype(cfg))
    hw = select(cfg.compile.hardware, torch.device("cuda"))
    layout = layout_of(cfg.parallelism, args.n_layers, lambda: models.stage_costs(args, build(), cfg.training.seq_len))
    if layout is not None:
        return solve_stages(cfg, args, layout, build, info, solver_mesh, torch.device("cpu"), param_dtype_for(cfg, "cuda"), hw)
    model = build()
    prepare_model(model)
    return solve(cfg, model, args, info, solver_mesh, torch.device("cpu"), param_dtype_for(cfg, "cuda"), hw)


def _against(argv: list[str]) -> tuple[str | None, list[str]]:
    """`--against meta` (or `--against=meta`) out of the argument list: the solver to compare with."""
    rest, against, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--against" or a.startswith("--against="):
            against = a.partition("=")[2] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in a else 2
            if against != "meta":
                raise ConfigError(f"--against {against!r}: the only solver to compare with is meta (Meta's AutoParallel): --against meta")
            continue
        rest.append(a)
        i += 1
    return against, rest


def cmd_plan(argv: list[str]) -> int:
    from .autoparallel import report

    against, argv = _against(argv)
    cfg = parse_args(argv)
    if against:
        from .autoparallel import plan_compare

        plan_compare.check(cfg)
        result = plan_compare.compare(cfg, make_plan(cfg))
        print(plan_compare.render(result))
        print(f"comparison written to {plan_compare.write(result, cfg.job.dump_folder)}")
        return 0
    plan = make_plan(cfg)
    ranks = math.prod(plan["mesh"]["shape"]) * plan.get("pipeline", {"pp": 1})["pp"]
    print(f"graph-trainer plan: {cfg.model.name} {cfg.model.flavor} on {ranks} ranks")
    print(report.render(plan))
    print(f"plan written to {report.write(plan, cfg.job.dump_folder)}")
    return 0
