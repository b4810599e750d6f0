"""`<dump_folder>/prediction.json`: what the cost model expects of the run's step, for the real job
of the mesh (world size from the mesh degrees; links by `--compile.hardware`: NVLink inside nodes of
8 GPUs, InfiniBand across), also when a fake process group simulates that job on one device.

It is read from the estimates `apply_passes` records for each captured graph as it reaches the backend's
compiling pass (passes/step_estimate.py; in aot_fx_trace after the parameter and activation policies and
the collective schedule): the train-step graph (aot_fx_trace), the joint graph (aot), or forward +
backward summed (jit). `exposed_comm_ms` is the time compute waits for collectives, issued and waited
for where the scheduled graph has them; `compute_ms` = `step_ms` - `exposed_comm_ms` (kernels, launches,
bucket copies); `comm_ms` every collective in series. Eager captures no graph and writes no file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .passes.registry import ESTIMATES
from .units import GiB


def predict(world_size: int) -> dict[str, Any] | None:
    """prediction.json's content from the latest capture's estimates (None without graphs)."""
    whole = next((s for s in ("train_step", "joint") if s in ESTIMATES), None)
    estimates = [ESTIMATES[whole]] if whole else [ESTIMATES[s] for s in ("forward", "backward") if s in ESTIMATES]
    if not estimates:
        return None
    memory: dict[str, float] = {}
    for e in estimates:
        for k, v in e.memory.items():
            memory[k] = max(memory.get(k, 0.0), v)
    hw = estimates[0].hardware
    step = sum(e.step_s for e in estimates)
    exposed = sum(e.exposed_comm_s for e in estimates)
    by_kind: dict[str, float] = {}
    for e in estimates:
        for kind, seconds in e.schedule.exposed_by_kind.items():
            by_kind[kind] = by_kind.get(kind, 0.0) + seconds
    return {
        "hardware": hw["hardware"],
        "bandwidths": {"intra_node_GBps": hw["intra_node_GBps"], "inter_node_GBps": hw["inter_node_GBps"]},
        "world_size": world_size,
        "graphs": [e.stage for e in estimates],
        "compute_ms": (step - exposed) * 1e3,
        "comm_ms": sum(e.comm_s for e in estimates) * 1e3,
        "exposed_comm_ms": exposed * 1e3,
        "exposed_comm_ms_by_kind": {kind: seconds * 1e3 for kind, seconds in sorted(by_kind.items())},
        "step_ms": step * 1e3,
        "memory_gib": {**{k: v / GiB for k, v in memory.items()}, "total": sum(memory.values()) / GiB},
    }


def write_prediction(dump_folder: str, world_size: int, pipelined: bool = False) -> dict[str, Any] | None:
    """Write prediction.json for the step the run captured (nothing in eager, nor with pipelining, whose
    captured graphs are one stage's for one microbatch: the step is the schedule's, which the cost model does
    not model); returns its content."""
    pred = None if pipelined else predict(world_size)
    # consumed: a later run in this process (tests) must not find this capture's estimates
    ESTIMATES.clear()
    if pred is not None:
        path = Path(dump_folder) / "prediction.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(pred, indent=1) + "\n")
    return pred
