"""The private torch pieces the collective scheduling passes use, imported in this one place.

The FSDP predicates are ours, written after `torch._inductor.fx_passes.bucketing`'s: their
signatures changed between releases (2.11 requires a precomputed ancestor map, 2.13 makes it
optional). We do not call its merge helpers or `overlap_scheduling`:
- `merge_all_gather` copies the bucket into a slice of an `empty` buffer in place and splits the
  result; the traced train step runs with autograd enabled on parameter shards that require grad,
  where that in-place write into a split view raises ("Output 0 of Split is a view and is being
  modified inplace"), and its argument order changed between 2.11 and 2.13;
- `schedule_overlap_bucketing` estimates compute with Triton's GPU roofline (on CPU it fails with
  "0 active drivers") and aligns benchmarked estimates across ranks.
So the merge and the schedule are ours (bucket_merge.py, bucket_plan.py), driven by cost_model.py.

Meta's optional `autoparallel` package is imported here too (`--compile.autoparallel_impl meta`).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterator

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.distributed_c10d import _resolve_process_group


_c10d = torch.ops._c10d_functional
ALL_GATHER = _c10d.all_gather_into_tensor.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_REDUCE = _c10d.all_reduce.default
ALL_TO_ALL = _c10d.all_to_all_single.default
WAIT = _c10d.wait_tensor.default


def ancestors(node: fx.Node) -> Iterator[fx.Node]:
    """Every node `node` derives from, each once, depth first (callers stop early)."""
    seen: set[fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        yield n
        todo.extend(n.all_input_nodes)


def is_fsdp_all_gather(node: fx.Node) -> bool:
    """An all-gather of one parameter: its input derives from exactly one graph input."""
    if node.target is not ALL_GATHER:
        return False
    inputs = 0
    for n in ancestors(node):
        if n.op == "placeholder":
            inputs += 1
            if inputs > 1:
                return False
    return inputs == 1


def group_size(group_name: str) -> int | None:
    """Ranks of the process group a functional collective names (an all-reduce's arguments do not say);
    None for a group this process does not have (a graph traced under an earlier fake process group)."""
    try:
        return _resolve_process_group(group_name).size()
    except RuntimeError:
        return None


def is_gradient_reduction(node: fx.Node) -> bool:
    """A gradient reduce-scatter (FSDP) or all-reduce (a replicated parameter): its result reaches the
    graph outputs through one-input ops only. A copy into a fresh buffer (`copy_(empty_strided(...),
    grad)`: autograd giving a gradient the strides of a parameter stored transposed) counts as
    one-input: the buffer holds no data."""
    if node.target not in (REDUCE_SCATTER, ALL_REDUCE):
        return False
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user.op == "output":
                continue
            if len([i for i in user.all_input_nodes if i.all_input_nodes or i.op == "placeholder"]) != 1:
                return False
            todo.append(user)
    return True


def fake_mode_of(values: list[Any]) -> FakeTensorMode:
    """The fake mode the graph was traced under (so new values share its shape environment)."""
    for v in values:
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


META_AUTOPARALLEL_INSTALL = (
    "pip install git+https://github.com/meta-pytorch/autoparallel@da99589 "
    "(the newest commit that runs on torch 2.11)"
)


def meta_autobucketing() -> tuple[Callable[..., fx.GraphModule], type] | None:
    """Meta AutoParallel's aten-level bucketing/reordering pass and its config class, or None when
    the package is not installed (the module moved between its releases)."""
    for module in ("autoparallel.graph_passes.auto_bucketing", "autoparallel.auto_bucketing"):
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        fn = getattr(found, "aten_autobucketing_reordering_pass", None)
        config = getattr(found, "aten_autobucketing_config", None)
        if fn is not None and config is not None:
            return fn, config
    return None
