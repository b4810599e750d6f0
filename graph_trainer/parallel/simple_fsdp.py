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

An eager step (`direct_gathers`) runs the same casts and collectives without DTensor's redistribute,
whose per-call planning took about 140 us of host time (torch 2.13, CPU; 50 us the direct gather) at
every gather (forward, recompute, regather) and again for every gradient's reduce-scatter. Under tensor
parallelism a rank's GPU work per block halves while this host work does not: the eager step's device
work is torchtitan's, its host work was not (bench/step_ops.py). Traced steps keep the redistribute:
their graphs are what the passes match.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from .compat import all_gather_single, reduce_scatter_single, view_base
from .mesh import Meshes

DP_STORAGE_DIMS = ("dp_replicate", "dp_shard", "efsdp")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtype names the config's mixed-precision settings take."""


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype

    @staticmethod
    def from_config(training: Any, device_type: str) -> "MixedPrecision":
        """`training.mixed_precision_param` "auto" is bfloat16 on GPU, float32 on CPU, and the stored dtype where
        that is bfloat16 (`training.dtype`)."""
        name = training.mixed_precision_param
        if name == "auto":
            name = "bfloat16" if device_type == "cuda" or training.dtype == "bfloat16" else "float32"
        return MixedPrecision(DTYPES[name], DTYPES[training.mixed_precision_reduce])


@dataclass(frozen=True)
class ParamGather:
    """Storage DTensor -> the tensor a module computes with (local, or a DTensor on the TP/EP mesh)."""

    dp_dims: tuple[int, ...]
    compute_mesh: DeviceMesh | None
    compute_placements: tuple[Placement, ...]
    mp: MixedPrecision

    def __call__(self, param: DTensor) -> torch.Tensor:
        direct = self._direct_gather(param) if _DIRECT else None
        local = self._redistribute(param) if direct is None else _GatherShard.apply(param.to_local(), direct, self.mp)
        out = local if self.compute_mesh is None else DTensor.from_local(local, self.compute_mesh, self.compute_placements, run_check=False)
        if _GATHERED:
            root = _root(out)
            _GATHERED[-1][id(root)] = (weakref.ref(root), self, param)
        return out

    def _redistribute(self, param: DTensor) -> torch.Tensor:
        replicated = [Replicate() if i in self.dp_dims else p for i, p in enumerate(param.placements)]
        forward_dtype = self.mp.param_dtype if self.mp.param_dtype != param.dtype else None
        backward_dtype = self.mp.reduce_dtype if self.mp.reduce_dtype != param.dtype else None
        gathered = param.redistribute(
            param.device_mesh, replicated, forward_dtype=forward_dtype, backward_dtype=backward_dtype
        )
        grad_placements = [Partial("avg") if i in self.dp_dims else p for i, p in enumerate(param.placements)]
        return gathered.to_local(grad_placements=grad_placements)

    def _direct_gather(self, param: DTensor) -> tuple[DeviceMesh, int, int] | None:
        """(mesh, mesh dim, tensor dim) of the one data-parallel gather `param` needs, where
        `_GatherShard` gives what the redistribute gives: one dp mesh dimension of more than one rank,
        sharded evenly (DTensor pads uneven shards; a replicated dimension of several ranks all-reduces
        the gradient). None: the redistribute does it."""
        mesh = param.device_mesh
        gathered = [i for i in self.dp_dims if mesh.size(i) > 1]
        if len(gathered) != 1:
            return None
        (i,) = gathered
        placement = param.placements[i]
        if type(placement) is not Shard or param.shape[placement.dim] % mesh.size(i):
            return None
        return mesh, i, placement.dim


class _GatherShard(torch.autograd.Function):
    """A parameter's local shard cast to the compute dtype and all-gathered along one mesh dimension;
    backward: the gradient cast to the reduce dtype, reduce-scattered (average) and cast to the
    parameter's dtype. The casts and collectives of `param.redistribute(..., forward_dtype,
    backward_dtype)` followed by `to_local(grad_placements=Partial("avg"))`, in the same order on the
    same values, so an eager step is bitwise the traced one."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, gather: tuple[DeviceMesh, int, int], mp: MixedPrecision) -> torch.Tensor:
        mesh, mesh_dim, dim = gather
        ctx.gather, ctx.reduce_dtype, ctx.param_dtype = gather, mp.reduce_dtype, shard.dtype
        return all_gather_single(shard.to(mp.param_dtype), dim, (mesh, mesh_dim))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        mesh, mesh_dim, dim = ctx.gather
        grad = reduce_scatter_single(grad.to(ctx.reduce_dtype).contiguous(), "avg", dim, (mesh, mesh_dim))
        return grad.to(ctx.param_dtype), None, None


_DIRECT: list[bool] = []
"""Non-empty while `direct_gathers` is active."""


@contextlib.contextmanager
def direct_gathers() -> Iterator[None]:
    """Parameters read inside gather through `_GatherShard` where it applies (eager steps only: a
    trace keeps DTensor's redistribute, whose graph the passes know)."""
    _DIRECT.append(True)
    try:
        yield
    finally:
        _DIRECT.pop()


_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def resharded_params(fqns: Sequence[str], policy: str) -> set[str]:
    """The parameters (of `fqns`, in the model's order) whose gathered value is freed after forward
    and gathered again for backward under `--parallelism.reshard_after_forward policy`.

    `always`: all; `never`: none; `default`: all but the parameters after the last transformer block
    (final norm, output projection): backward starts with them, so gathering them again right after
    forward would only add an all-gather. FSDP2 keeps the last block's parameters gathered as well;
    here the last block is resharded like the others, so that every block's forward and backward is
    the same graph, compiled once (passes/block_compile.py: on llama3 8B with selective op AC the kept
    block made a forward and a backward piece of their own, two of the step's four large compiles),
    and its gather for backward is prefetched under the loss.
    """
    if policy == "never":
        return set()
    blocks = [i for i, f in enumerate(fqns) if _BLOCK.search(f)]
    if policy == "always" or not blocks:
        return set(fqns)
    return set(fqns[: blocks[-1] + 1])


_GATHERED: list[dict[int, tuple[weakref.ref, ParamGather, nn.Parameter]]] = []
"""While `reshard_after_forward` is active: the storage of each gathered parameter of the step, by id
(weakly: the point is that it can die after forward)."""


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns `t`'s storage (`t` itself unless it is a view)."""
    base = view_base(t)
    return t if base is None else base


@dataclass(frozen=True)
class _Regather:
    """A saved gathered parameter between forward and backward: only its shard is referenced."""

    gather: ParamGather
    param: nn.Parameter
    view: tuple[torch.Size, tuple[int, ...], int] | None
    """Size, stride and offset of the saved view of the gathered value (None: the value itself)."""

    def __call__(self) -> torch.Tensor:
        with torch.no_grad():
            full = _root(self.gather(self.param))
        return full if self.view is None else full.as_strided(*self.view)


@contextlib.contextmanager
def reshard_after_forward(model: nn.Module, policy: str) -> Iterator[None]:
    """Eager forward + backward under `--parallelism.reshard_after_forward policy`.

    Autograd saves a gathered weight (or a view of it, such as the transpose a matmul keeps) for the
    backward of the op that read it, which holds the whole unsharded parameter until backward. Here
    such a saved tensor of a resharded parameter is replaced by its shard and gathered again (one more
    all-gather) when backward unpacks it, so the forward copy dies after its last forward use. What the
    traced modes do with their graphs (passes/reshard.py), done with autograd's saved-tensor hooks.
    """
    fqns = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    chosen = {id(params[f]) for f in resharded_params(fqns, policy)}
    gathered: dict[int, tuple[weakref.ref, ParamGather, nn.Parameter]] = {}

    def pack(t: torch.Tensor) -> Any:
        root = _root(t)
        entry = gathered.get(id(root))
        if entry is None or entry[0]() is not root or id(entry[2]) not in chosen:
            return t
        if t is root:
            return _Regather(entry[1], entry[2], None)
        if isinstance(t, DTensor):
            # A view of a plain tensor is rebuilt from its strides; DTensor views (of TP weights) stay saved.
            return t
        return _Regather(entry[1], entry[2], (t.size(), t.stride(), t.storage_offset()))

    def unpack(saved: Any) -> torch.Tensor:
        return saved() if isinstance(saved, _Regather) else saved

    if not chosen:
        yield
        return
    _GATHERED.append(gathered)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _GATHERED.pop()


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
