"""The plan as a person reads it (a table) and as a file (plan.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..units import GiB


def _placement(p: str) -> str:
    if p.startswith("S"):
        return f"S({p[1:]})"
    if p.startswith("P") and p != "P":
        return f"P({p[1:]})"
    return p


def _spec(spec: list[str], dims: list[str]) -> str:
    return ",".join(_placement(p) for p in spec) if dims else "-"


def render(plan: dict[str, Any]) -> str:
    if "stages" not in plan:
        return _render_one(plan)
    pipe = plan["pipeline"]
    parts = [f"pipeline: pp {pipe['pp']}, {pipe['schedule']}, {pipe['microbatches']} microbatches; each stage placed on the "
             "mesh of its pipeline rank, its input and output laid out like the token batch"]
    for s, (layers, stage) in enumerate(zip(pipe["layers"], plan["stages"])):
        held = f"layers {layers[0]}-{layers[-1]}" if layers else "no layers"
        parts.append(f"\n== stage {s} (pipeline rank {s % pipe['pp']}, {held}) ==\n{_render_one(stage)}")
    return "\n".join(parts)


def _render_one(plan: dict[str, Any]) -> str:
    dims = plan["mesh"]["solver_dims"]
    shape = dict(zip(plan["mesh"]["names"], plan["mesh"]["shape"]))
    lines = [
        f"mesh {' x '.join(f'{n}={shape[n]}' for n in plan['mesh']['names'])}; placements below are per solver dim "
        f"({', '.join(dims) or 'none: one rank'}); batch {_spec(plan['batch_spec'], dims)}",
        "",
        f"{'parameter':44s} {'shape':>16s} {'x':>4s}  {'storage':12s} {'compute':12s}",
    ]
    for name, p in plan["params"].items():
        lines.append(f"{name:44s} {str(tuple(p['shape'])):>16s} {p['count']:4d}  {_spec(p['storage'], dims):12s} {_spec(p['compute'], dims):12s}")
    if plan.get("moe"):
        lines += ["", "routed experts (one op per MoE block; per mesh dim: replicate, tokens = FSDP-like, experts = EP, hidden = Megatron-like):"]
        for name, m in plan["moe"].items():
            choice = ", ".join(f"{d}={c}" for d, c in m["choice"].items()) or "one rank"
            ep = m["expert_parallel"]
            how = f"expert parallel over {ep['dim']}, ep={ep['degree']}" if ep else "no expert parallelism"
            factor = m["capacity_factor"]
            lines.append(f"  {name:42s} {m['count']:4d}  {choice}  ({how}; capacity factor {factor:g}"
                         f"{' = never drops' if factor <= 0 else ''}; chosen among {m['alternatives']})")
    pred = plan["predicted"]
    lines += ["", "predicted per step and rank:"]
    for kind, v in pred["communication"].items():
        lines.append(f"  {kind:32s} {int(v['count']):6d} x  {v['bytes'] / GiB:9.3f} GiB  {v['time_s'] * 1e3:9.3f} ms")
    hw = pred["hardware"]
    memory = ", ".join(f"{k.replace('_', ' ')} {v / GiB:.2f}" for k, v in pred["memory_bytes"].items() if v)
    lines += [
        f"  {'communication (all, in series)':32s} {'':6s}    {'':9s}     {pred['communication_s'] * 1e3:9.3f} ms",
        f"  {'compute + optimizer':32s} {'':6s}    {'':9s}     {pred['compute_and_optimizer_s'] * 1e3:9.3f} ms",
        f"  {'exposed communication':32s} {'':6s}    {'':9s}     {pred['exposed_communication_s'] * 1e3:9.3f} ms",
        f"  {'step (overlapped)':32s} {'':6s}    {'':9s}     {pred['step_s'] * 1e3:9.3f} ms",
        f"  on {hw['hardware']} (links {hw['intra_node_GBps']:g} GB/s in a node, {hw['inter_node_GBps']:g} GB/s across nodes)",
        f"  memory: {pred['memory_per_rank_bytes'] / GiB:.2f} GiB ({memory} GiB) of a {pred['memory_budget_bytes'] / GiB:.2f} GiB budget"
        + (f"; activations counted with activation checkpointing '{pred['activation_checkpoint']}'" if pred["activation_checkpoint"]
           else "; activations not counted"),
    ]
    prog = plan["program"]
    lines += [
        "",
        f"program: {prog['variables']} variables, {prog['constraints']} constraints; solved by {prog['method']} ({prog['status']}) "
        f"(LP relaxation integral: {prog['lp_integral']}); {prog['strategy_queries']} strategy queries "
        f"({prog['strategy_cache_hits']} cached)",
        f"time: trace {prog['trace_s']:.2f} s + build {prog['build_s']:.2f} s + solve {prog['solve_s']:.2f} s = {prog['total_s']:.2f} s",
    ]
    fallbacks = plan["fallbacks"]
    lines.append("ops without a DTensor strategy (replicated): " + ("; ".join(fallbacks) if fallbacks else "none"))
    return "\n".join(lines)


def write(plan: dict[str, Any], folder: str) -> Path:
    path = Path(folder) / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1))
    return path
