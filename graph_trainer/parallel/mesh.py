"""Parallelism degrees and the device meshes built from them.

Ranks are laid out row-major as (dp_replicate, dp_shard, tp) for dense parameters. MoE experts
reuse the same ranks as (dp_replicate, efsdp, ep) with efsdp * ep == dp_shard * tp: expert
parallelism borrows ranks from data and tensor parallelism, as in torchtitan. Pipeline parallelism
is outermost, as in torchtitan: the dense and sparse meshes are one pipeline rank's slices of
(pp, dp_replicate, dp_shard, tp) and (pp, dp_replicate, efsdp, ep).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DENSE_DIMS = ("dp_replicate", "dp_shard", "tp")
SPARSE_DIMS = ("dp_replicate", "efsdp", "ep")
DP_DIMS = ("dp_replicate", "dp_shard")
PP_DIM = "pp"


@dataclass(frozen=True)
class Degrees:
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        return self.dp_shard * self.tp // self.ep

    def dense_shape(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.dp_shard, self.tp)

    def sparse_shape(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.efsdp, self.ep)


def resolve_degrees(dp_replicate: int, dp_shard: int, tp: int, ep: int, world_size: int, pp: int = 1) -> Degrees:
    """Fill dp_shard=-1 from the world size; the validator has already checked divisibility."""
    if dp_shard == -1:
        dp_shard = world_size // (pp * dp_replicate * tp)
    return Degrees(dp_replicate, dp_shard, tp, ep, pp)


@dataclass
class Meshes:
    degrees: Degrees
    dense: DeviceMesh
    sparse: DeviceMesh | None
    pp: DeviceMesh | None = None
    """The pipeline dimension (None without pipeline parallelism)."""

    @property
    def dp(self) -> DeviceMesh:
        return self.dense[DP_DIMS]

    @property
    def tp(self) -> DeviceMesh:
        return self.dense["tp"]

    @property
    def ep(self) -> DeviceMesh:
        assert self.sparse is not None
        return self.sparse["ep"]

    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (TP peers share it: they read the same data)."""
        rep = self.dense.get_local_rank("dp_replicate")
        shard = self.dense.get_local_rank("dp_shard")
        return rep * self.degrees.dp_shard + shard

    def root_of(self, dim_name: str) -> DeviceMesh:
        """The full mesh that holds a named dimension: dense for tp, sparse for ep."""
        if dim_name in DENSE_DIMS:
            return self.dense
        assert self.sparse is not None and dim_name in SPARSE_DIMS, dim_name
        return self.sparse


def build_meshes(degrees: Degrees, device_type: str) -> Meshes:
    if degrees.pp > 1:
        return _pipelined_meshes(degrees, device_type)
    dense = init_device_mesh(device_type, degrees.dense_shape(), mesh_dim_names=DENSE_DIMS)
    sparse = None
    if degrees.ep > 1:
        sparse = init_device_mesh(device_type, degrees.sparse_shape(), mesh_dim_names=SPARSE_DIMS)
    return Meshes(degrees, dense, sparse)


def _pipelined_meshes(degrees: Degrees, device_type: str) -> Meshes:
    world = init_device_mesh(device_type, (degrees.pp, *degrees.dense_shape()), mesh_dim_names=(PP_DIM, *DENSE_DIMS))
    sparse = None
    if degrees.ep > 1:
        sparse_world = init_device_mesh(device_type, (degrees.pp, *degrees.sparse_shape()), mesh_dim_names=(PP_DIM, *SPARSE_DIMS))
        sparse = sparse_world[SPARSE_DIMS]
    return Meshes(degrees, world[DENSE_DIMS], sparse, world[PP_DIM])


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
