"""`graph-trainer plan --against meta`: the same model and mesh placed by the built-in solver and by
Meta's AutoParallel, and each plan priced under both cost models.

Both solvers work on one fake process group standing for the mesh (plan.py sets it up). A plan is
priced by a cost model as that model's best step with the plan's parameter storage layouts pinned:
the model then chooses the rest (activation layouts, where to gather) itself. A solver's own plan
priced by its own model is therefore its optimum. Ours: `planner.price_placement` on Meta's storage
layouts. Meta's: its own program re-solved with each parameter's placeholder pinned to our layout
(`meta_adapter.solve_pinned`), then its objective's terms for that solution (`meta_adapter.price`).

The two models count different things. Ours predicts a step (compute + optimizer, communication, the
step after overlap) and the memory of parameters, gradients, optimizer state and (when the job's AC
policy says so) activations. Meta's objective is a sum over the graph's ops of compute and
redistribution times in microseconds, plus a tie-breaking count of layout transitions; its memory
row bounds only the parameters' sharded share, shown here as bytes of parameters, gradients and
Adam state in its layouts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ..config import ConfigError, JobConfig
from ..units import GiB


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """plan.json's `layers.*.attention.wq.weight` as a regex over FQNs (`*` is a block index)."""
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")


def per_fqn(patterns: dict[str, list[str]], fqns: list[str]) -> dict[str, list[str]]:
    """Our plan's storage layouts (by pattern) for each parameter FQN."""
    compiled = [(_pattern_regex(p), spec) for p, spec in patterns.items()]
    out = {}
    for fqn in fqns:
        found = [spec for rx, spec in compiled if rx.match(fqn)]
        if len(found) != 1:
            raise ConfigError(f"plan --against meta: parameter {fqn} matches {len(found)} patterns of the built-in plan")
        out[fqn] = list(found[0])
    return out


def per_pattern(specs: dict[str, list[str]], patterns: list[str]) -> tuple[dict[str, tuple[str, ...]], dict[str, int]]:
    """Meta's layouts (by FQN) for each of our patterns: the layout most of its blocks have, and for
    each pattern how many blocks Meta placed otherwise (it may place repeated blocks differently)."""
    chosen, differing = {}, {}
    for pattern in patterns:
        rx = _pattern_regex(pattern)
        counts = Counter(tuple(spec) for fqn, spec in specs.items() if rx.match(fqn))
        (top, n), *_ = counts.most_common()
        chosen[pattern] = top
        differing[pattern] = sum(counts.values()) - n
    return chosen, differing


def _ours(predicted: dict[str, Any]) -> dict[str, float]:
    keep = ("compute_and_optimizer_s", "communication_s", "exposed_communication_s", "step_s", "objective_s", "memory_per_rank_bytes")
    return {k: predicted[k] for k in keep if k in predicted}


def check(cfg: JobConfig) -> None:
    """What the comparison needs, checked before the built-in plan is solved."""
    from .. import models
    from . import meta_adapter

    if models.get_spec(cfg.model.name).is_moe:
        raise ConfigError(f"plan --against meta compares dense models only (Meta's placer does not take {cfg.model.name} here)")
    meta_adapter.require()


def compare(cfg: JobConfig, ours: dict[str, Any]) -> dict[str, Any]:
    """`ours`: the built-in solver's plan (plan.json's content), solved on the fake process group this
    comparison then uses (the caller, plan.py, owns both)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from .. import models
    from ..parallel.simple_fsdp import MixedPrecision
    from . import meta_adapter
    from ..hardware import select
    from ..units import parse_memory_budget
    from .entry import mesh_info, solver_settings
    from .planner import price_placement

    spec = models.get_spec(cfg.model.name)
    info = mesh_info(tuple(ours["mesh"]["shape"]))
    if not info.sizes:
        raise ConfigError("plan --against meta needs a mesh of more than one rank: pass --parallelism.dp_shard N (and tp)")
    mesh = init_device_mesh("cpu", info.sizes, mesh_dim_names=info.solver_names)
    args = spec.job_args(cfg)
    t = cfg.training
    batch = (t.batch_size // t.gradient_accumulation_steps, t.seq_len)
    mp = MixedPrecision.from_config(t, "cuda")
    param_dtype = mp.param_dtype
    hw = select(cfg.compile.hardware, torch.device("cuda"))
    budget = parse_memory_budget(cfg.compile.autoparallel_memory_budget, hw.device_memory_bytes)

    with meta_adapter.session(models.build_on_meta(spec, args, "cpu"), batch, mesh, mp, budget) as s:
        t0 = time.perf_counter()
        solution = s.autop.optimize_placement()
        solve_s = time.perf_counter() - t0
        meta_specs = meta_adapter.parameter_specs(s, solution)
        meta_own = meta_adapter.price(s, solution)
        our_specs = per_fqn({p: v["storage"] for p, v in ours["params"].items()}, list(meta_specs))
        t0 = time.perf_counter()
        meta_on_ours = meta_adapter.price(s, meta_adapter.solve_pinned(s, our_specs))
        pinned_solve_s = time.perf_counter() - t0
        meta_times = {"trace_s": s.trace_s, "build_s": s.build_s, "solve_s": solve_s}

    storage, differing = per_pattern(meta_specs, list(ours["params"]))
    model = models.build_on_meta(spec, args, "cpu")
    # a price, not a plan to run: Meta's plan answers to its own memory row, so ours does not bind it
    settings = dataclasses.replace(solver_settings(cfg, model, hw), memory_budget=math.inf)
    ours_on_meta = price_placement(model, batch, param_dtype, torch.device("cpu"), info, mesh, settings, storage).data
    prog = ours["program"]
    mesh_desc = dict(zip(info.solver_names, info.sizes))
    return {
        "model": ours["model"], "mesh": mesh_desc, "batch": ours["batch"], "memory_budget_bytes": budget,
        "meta_priced_as": meta_adapter.PRICED_AS,
        "plans": {
            "builtin": {
                "plan_time_s": {"trace_s": prog["trace_s"], "build_s": prog["build_s"], "solve_s": prog["solve_s"]},
                "params": our_specs,
                "predicted": {"builtin": _ours(ours["predicted"]), "meta": meta_on_ours},
            },
            "meta": {
                "plan_time_s": meta_times,
                "params": meta_specs,
                "predicted": {"builtin": _ours(ours_on_meta["predicted"]), "meta": meta_own},
            },
        },
        "by_pattern": {p: {"builtin": list(v["storage"]), "meta": list(storage[p]), "meta_blocks_placed_otherwise": differing[p]}
                       for p, v in ours["params"].items()},
        "meta_pinned_resolve_s": pinned_solve_s,
        "differing_params": sorted(f for f in meta_specs if meta_specs[f] != our_specs[f]),
    }


def render(result: dict[str, Any]) -> str:
    mesh = " x ".join(f"{n} {s}" for n, s in result["mesh"].items())
    m = result["model"]
    lines = [f"graph-trainer plan --against meta: {m['name']} {m['flavor']} on {mesh} "
             f"(Meta's compute priced as {result['meta_priced_as']})", ""]
    plans = result["plans"]
    lines.append(f"{'plan':8s} {'trace s':>8s} {'build s':>8s} {'solve s':>8s}")
    for name, p in plans.items():
        pt = p["plan_time_s"]
        lines.append(f"{name:8s} {pt['trace_s']:8.2f} {pt['build_s']:8.2f} {pt['solve_s']:8.2f}")
    lines += ["", "predicted step per rank (each plan under each cost model):"]
    lines.append(f"{'plan':8s} {'model':8s} {'compute ms':>11s} {'comm ms':>9s} {'step/objective ms':>18s} {'memory GiB':>11s}")
    for name, p in plans.items():
        ours, meta = p["predicted"]["builtin"], p["predicted"]["meta"]
        lines.append(f"{name:8s} {'builtin':8s} {ours['compute_and_optimizer_s'] * 1e3:11.2f} {ours['communication_s'] * 1e3:9.2f} "
                     f"{ours.get('step_s', ours['objective_s']) * 1e3:18.2f} {ours['memory_per_rank_bytes'] / GiB:11.2f}")
        lines.append(f"{name:8s} {'meta':8s} {meta['compute_s'] * 1e3:11.2f} {meta['communication_s'] * 1e3:9.2f} "
                     f"{meta['objective_s'] * 1e3:18.2f} {meta['memory_per_rank_bytes'] / GiB:11.2f}")
    diff, total = len(result["differing_params"]), len(plans["builtin"]["params"])
    lines += ["", f"parameter storage layouts over ({', '.join(result['mesh'])}): {diff} of {total} parameters differ (*); "
              f"every FQN in plan_compare.json"]
    lines.append(f"  {'parameter':44s} {'builtin':12s} meta")
    for pattern, v in result["by_pattern"].items():
        mark = "*" if v["builtin"] != v["meta"] or v["meta_blocks_placed_otherwise"] else " "
        other = f" ({v['meta_blocks_placed_otherwise']} blocks otherwise)" if v["meta_blocks_placed_otherwise"] else ""
        lines.append(f"{mark} {pattern:44s} {','.join(v['builtin']):12s} {','.join(v['meta'])}{other}")
    return "\n".join(lines)


def write(result: dict[str, Any], folder: str) -> Path:
    path = Path(folder) / "plan_compare.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path

