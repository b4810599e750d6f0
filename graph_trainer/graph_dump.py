"""Graph dumps: readable code of each stage (`NN_<stage>.py`) and `summary.json`, which the compare
tool, the bucketing tests and the solver report read.

A summary entry per stage: node count, and for each collective kind its count and bytes (the size of
the tensor each rank holds after the collective: the gathered tensor for all-gather, the shard for
reduce-scatter), and how many of them carry more than one tensor (buckets).

The table of collective ops below is the one place ops are recognised as collectives: the summaries,
the cost model (passes/cost_model.py), the step estimate and the passes that keep collectives out of
compiled regions or recomputation all ask `collective_kind` / `is_collective`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import fx

_FUNCTIONAL = ("_c10d_functional", "c10d_functional")
"""Namespaces of torch's functional collectives (each paired with a `wait_tensor`)."""

_COLLECTIVES = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    # DTensor's Shard(i) -> Shard(j) on a GPU mesh: an all-to-all that returns its result directly
    # (no wait node); its arguments end with the group name like the functional ones'.
    "shard_dim_alltoall": "all_to_all",
}
"""Op name -> collective kind, for ops of `_FUNCTIONAL` and of `_dtensor`."""

BUCKET_META = "bucket_size"
"""node.meta key a bucketing pass sets on a collective: how many tensors it carries."""


def _namespace(node: fx.Node) -> str | None:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    return node.target.namespace


def collective_kind(node: fx.Node) -> str | None:
    if _namespace(node) not in (*_FUNCTIONAL, "_dtensor"):
        return None
    return _COLLECTIVES.get(node.target._opname)


def is_collective(node: fx.Node) -> bool:
    """A collective or a functional collective's wait: what stays out of compiled regions and is
    never recomputed."""
    return _namespace(node) in _FUNCTIONAL or collective_kind(node) is not None


def nbytes(val: Any) -> int:
    """Bytes of a tensor or of a (nested) list of tensors; 0 for anything else."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(nbytes(v) for v in val)
    return 0


def summarize(gm: fx.GraphModule) -> dict[str, Any]:
    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0, "buckets": 0})
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        entry = counts[kind]
        entry["count"] += 1
        entry["bytes"] += nbytes(node.meta.get("val"))
        if node.meta.get(BUCKET_META, 1) > 1:
            entry["buckets"] += 1
    return {"nodes": len(gm.graph.nodes), "collectives": dict(sorted(counts.items()))}


class GraphDumper:
    """Writes one file per stage when enabled; always keeps the summaries (the trainer logs them)."""

    def __init__(self, folder: str | Path | None):
        self.folder = Path(folder) if folder else None
        self.stages: list[dict[str, Any]] = []
        if self.folder:
            self.folder.mkdir(parents=True, exist_ok=True)

    def dump(self, stage: str, gm: fx.GraphModule, **extra: Any) -> None:
        entry = {"stage": stage, **summarize(gm), **extra}
        self.stages.append(entry)
        if not self.folder:
            return
        index = len(self.stages) - 1
        code = gm.print_readable(print_output=False, include_stride=True, include_device=True)
        (self.folder / f"{index:02d}_{stage}.py").write_text(code)
        (self.folder / "summary.json").write_text(json.dumps({"stages": self.stages}, indent=2) + "\n")
