"""SimpleFSDP: parameters stored as DTensors sharded over the data-parallel mesh dimensions and
gathered, when a module reads them, by a DTensor redistribute.

Because the gather is an ordinary differentiable op on the parameter, a traced train step shows it
as an all-gather in forward and, through `grad_placements=Partial("avg")`, a reduce-scatter (or an
all-reduce on `dp_replicate`) of the gradient in backward. Those are the collectives the graph passes
bucket and reorder.

A parameter already placed by TP or EP (a DTensor on the 1-D `tp` or `ep` mesh) is stored on the
full mesh that holds that dimension, sharded for data parallelism on its first tensor dimension that
TP/EP does not shard: every layout is a plain `Shard` (no strided sharding), so checkpoints reshard
across meshes with stock DCP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from .mesh import Meshes

DP_STORAGE_DIMS = ("dp_replicate", "dp_shard", "efsdp")


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype


@dataclass(frozen=True)
class ParamGather:
    """Storage DTensor -> the tensor a module computes with (local, or a DTensor on the TP/EP mesh)."""

    dp_dims: tuple[int, ...]
    compute_mesh: DeviceMesh | None
    compute_placements: tuple[Placement, ...]
    mp: MixedPrecision

    def __call__(self, param: DTensor) -> torch.Tensor:
        replicated = [Replicate() if i in self.dp_dims else p for i, p in enumerate(param.placements)]
        forward_dtype = self.mp.param_dtype if self.mp.param_dtype != param.dtype else None
        backward_dtype = self.mp.reduce_dtype if self.mp.reduce_dtype != param.dtype else None
        gathered = param.redistribute(
            param.device_mesh, replicated, forward_dtype=forward_dtype, backward_dtype=backward_dtype
        )
        grad_placements = [Partial("avg") if i in self.dp_dims else p for i, p in enumerate(param.placements)]
        local = gathered.to_local(grad_placements=grad_placements)
        if self.compute_mesh is None:
            return local
        return DTensor.from_local(local, self.compute_mesh, self.compute_placements, run_check=False)


_GATHERING_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _gathering_class(cls: type, names: tuple[str, ...]) -> type:
    """A subclass whose parameter attributes gather; `_parameters` keeps the sharded storage, so
    `parameters()`, `state_dict()` and optimizers see DTensors while `forward` sees full tensors."""
    key = (cls, names)
    if key not in _GATHERING_CLASSES:
        props = {n: property(lambda self, n=n: self._fsdp_gathers[n](self._parameters[n])) for n in names}
        _GATHERING_CLASSES[key] = type(f"SimpleFSDP{cls.__name__}", (cls,), props)
    return _GATHERING_CLASSES[key]


def storage_layout(param: torch.Tensor, meshes: Meshes) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements a parameter is stored with."""
    if isinstance(param, DTensor):
        (inner_dim,) = param.device_mesh.mesh_dim_names
        (inner,) = param.placements
        root = meshes.root_of(inner_dim)
        taken = inner.dim if isinstance(inner, Shard) else -1
        fsdp_dim = 1 if taken == 0 and param.ndim > 1 else 0
    else:
        inner_dim, inner, root, fsdp_dim = "tp", Replicate(), meshes.dense, 0
    placements = []
    for name in root.mesh_dim_names:
        if name == inner_dim:
            placements.append(inner)
        elif name == "dp_replicate":
            placements.append(Replicate())
        elif name in DP_STORAGE_DIMS:
            placements.append(Shard(fsdp_dim))
        else:
            placements.append(Replicate())
    return root, tuple(placements)


def apply_simple_fsdp(model: nn.Module, meshes: Meshes, mp: MixedPrecision) -> nn.Module:
    """Re-register every parameter as a sharded storage DTensor and make its attribute gather.

    Works on a meta-device model: storage is allocated later by `materialize`.
    """
    for module in list(model.modules()):
        direct = {n: p for n, p in module.named_parameters(recurse=False) if p is not None}
        if not direct:
            continue
        gathers: dict[str, ParamGather] = {}
        for name, param in direct.items():
            assert param.device.type == "meta", "apply SimpleFSDP before materialising the model"
            root, placements = storage_layout(param, meshes)
            global_meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
            storage = distribute_tensor(global_meta, root, placements, src_data_rank=None)
            module._parameters[name] = nn.Parameter(storage, requires_grad=param.requires_grad)
            dp_dims = tuple(i for i, d in enumerate(root.mesh_dim_names) if d in DP_STORAGE_DIMS)
            if isinstance(param, DTensor):
                compute = (param.device_mesh, tuple(param.placements))
            else:
                compute = (None, ())
            gathers[name] = ParamGather(dp_dims, compute[0], compute[1], mp)
        module._fsdp_gathers = gathers
        module.__class__ = _gathering_class(type(module), tuple(sorted(gathers)))
    return model
