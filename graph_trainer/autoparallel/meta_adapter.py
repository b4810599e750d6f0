"""`--compile.autoparallel_impl meta`: placement chosen and applied by Meta's AutoParallel
(github.com/meta-pytorch/autoparallel) instead of the built-in solver.

The package is optional and not on the package registries (`META_AUTOPARALLEL_INSTALL` says how to
install the newest commit that runs on torch 2.11). What this adapter relies on, as read at that
commit: `AutoParallel(model, input_fn, mesh, mp_policy)` is a context manager that traces the
meta-device model's forward and backward on fake tensors of `input_fn()`'s shapes; inside it
`add_parameter_memory_constraint(low, high)` bounds each rank's share of the parameters,
`add_input_constraints` / `add_output_constraints` fix the placements of the batch and of the output,
`optimize_placement()` solves its integer program and `apply_placement(solution)` returns a module
whose parameters are DTensors in the chosen layouts (same FQNs, still on meta: `materialize` fills
them) and whose forward runs the placed graphs.

What it does not cover: MoE models (its MoE support needs its own model definitions), plan files
and `graph-trainer plan` (they are the built-in solver's), and our cost model's hardware numbers
(it uses its own). `check_autoparallel` refuses those combinations up front.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from ..config import ConfigError
from ..passes.bucketing_compat import META_AUTOPARALLEL_INSTALL
from .costs import GiB, state_bytes_per_element
from .planner import DP_DIMS

_API = ("add_parameter_memory_constraint", "add_input_constraints", "add_output_constraints", "optimize_placement", "apply_placement")


def auto_parallel_class() -> type | None:
    """Meta's `AutoParallel` if its package imports and has the API above, else None."""
    try:
        api = importlib.import_module("autoparallel.api")
    except Exception:  # noqa: BLE001  (a broken install on this torch counts as missing)
        return None
    cls = getattr(api, "AutoParallel", None)
    return cls if cls is not None and all(hasattr(cls, name) for name in _API) else None


def require() -> type:
    cls = auto_parallel_class()
    if cls is None:
        raise ConfigError(
            f"--compile.autoparallel_impl meta needs Meta's autoparallel package, which is not importable here: "
            f"{META_AUTOPARALLEL_INSTALL}; or use --compile.autoparallel_impl builtin"
        )
    return cls


def place(model: nn.Module, batch_shape: tuple[int, int], mesh: DeviceMesh, mp: Any, memory_budget: float) -> nn.Module:
    """Place a meta-device `model` on `mesh` (the mesh dims of size > 1) with Meta's solver; the batch
    (global `batch_shape` tokens) is sharded on the data-parallel dims and so is the output."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    auto_parallel = require()
    batch = tuple(Shard(0) if name in DP_DIMS else Replicate() for name in mesh.mesh_dim_names)
    state = sum(p.numel() * state_bytes_per_element(p.element_size()) for p in model.parameters())
    ranks = math.prod(mesh.shape)
    if memory_budget < state / ranks:
        smallest = math.ceil(state / ranks / GiB * 100) / 100
        raise ConfigError(f"autoparallel: the memory budget {memory_budget / GiB:.2f} GiB per rank is infeasible; set "
                          f"--compile.autoparallel_memory_budget {smallest:.2f}GiB or more, or use more ranks")

    def input_fn() -> torch.Tensor:
        return torch.zeros(batch_shape, dtype=torch.long, device=mesh.device_type)

    policy = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)
    with auto_parallel(model, input_fn, mesh, policy) as autop:
        autop.add_parameter_memory_constraint(low=None, high=min(1.0, memory_budget / state))
        autop.add_input_constraints([batch])
        autop.add_output_constraints([batch])
        return autop.apply_placement(autop.optimize_placement())
