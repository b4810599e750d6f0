"""Gradient clipping (clipping.py) on local shards equals torchtitan's clip_grad_norm_ on the DTensor
gradients bit for bit: the norm, and every gradient after scaling, with and without expert parallelism,
whether or not the clip binds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip_grad_norm_

from graph_trainer.clipping import clip_grad_norm_


@pytest.fixture(scope="module")
def meshes():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dense = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    experts = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    yield dense, experts
    dist.destroy_process_group()


def _params(meshes, with_experts: bool) -> list[DTensor]:
    """Every third parameter on the expert mesh with expert parallelism (without it one mesh holds all)."""
    dense, experts = meshes
    g = torch.Generator().manual_seed(0)
    params = []
    for i in range(9):
        expert = with_experts and i % 3 == 0
        mesh, placements = (experts, [Replicate(), Shard(0)]) if expert else (dense, [Replicate(), Shard(0), Replicate()])
        p = distribute_tensor(torch.randn(8, 5 + i, generator=g), mesh, placements)
        p.grad = distribute_tensor(torch.randn(8, 5 + i, generator=g) * (i + 1), mesh, placements)
        params.append(p)
    return params


@pytest.mark.parametrize("ep_enabled", [False, True])
@pytest.mark.parametrize("max_norm", [0.5, 1e4, math.inf])
def test_equals_torchtitans_clip_bit_for_bit(meshes, ep_enabled, max_norm):
    ours, theirs = _params(meshes, ep_enabled), _params(meshes, ep_enabled)
    before = [p.grad.to_local().clone() for p in ours]
    norm = clip_grad_norm_(ours, max_norm, ep_enabled)
    want = titan_clip_grad_norm_(theirs, max_norm, foreach=True, ep_enabled=ep_enabled)
    assert not isinstance(norm, DTensor) and torch.equal(norm, want)
    assert all(torch.equal(a.grad.to_local(), b.grad.to_local()) for a, b in zip(ours, theirs))
    scaled = [not torch.equal(p.grad.to_local(), b) for p, b in zip(ours, before)]
    # the norm of these gradients is ~160: a max_norm of 0.5 scales every one, 1e4 and inf none
    assert all(scaled) if max_norm == 0.5 else not any(scaled)
