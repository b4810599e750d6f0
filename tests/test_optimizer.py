"""The eager optimizer steps each parameter's local shard (graph_trainer/optimizer.py): bit for bit torch's
Adam/AdamW on the DTensors, without a single DTensor op."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from graph_trainer.optimizer import ShardLocalAdam, ShardLocalAdamW
from graph_trainer.parallel.compat import init_fake_process_group

# storage placements of SimpleFSDP (dp_shard) and TP parameters on (dp_replicate 1, dp_shard 2, tp 2)
PLACEMENTS = [
    ((Replicate(), Shard(0), Replicate()), (8, 6)),
    ((Replicate(), Shard(1), Shard(0)), (4, 8)),
    ((Replicate(), Shard(0), Replicate()), (6,)),
    ((Replicate(), Replicate(), Replicate()), (3, 2)),
]


class DTensorOps(TorchDispatchMode):
    """Counts the ops called with a DTensor argument (each one a DTensor dispatch)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.count += any(isinstance(a, DTensor) for a in pytree.tree_leaves((args, kwargs)))
        return func(*args, **kwargs)


@pytest.fixture
def mesh():
    init_fake_process_group(4, 0)
    yield init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    dist.destroy_process_group()


def _params(mesh, seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=g), mesh, list(placements)))
            for placements, shape in PLACEMENTS]


def _train(cls, mesh, implementation: str, count_dtensor_ops: list[int] | None = None) -> list[torch.Tensor]:
    params = _params(mesh, 0)
    opt = cls(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **{implementation: True})
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        for p, (placements, shape) in zip(params, PLACEMENTS):
            p.grad = distribute_tensor(torch.randn(shape, generator=g), mesh, list(placements))
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (step + 1)  # a schedule: each step's scalars differ
        if count_dtensor_ops is None:
            opt.step()
        else:
            with DTensorOps() as seen:
                opt.step()
            count_dtensor_ops.append(seen.count)
    moments = [t for p in params for t in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    assert all(isinstance(t, DTensor) for t in moments), "the moments stay DTensors (DCP saves and reshards them)"
    return [t.to_local() for t in [*params, *moments]] + [opt.state[params[0]]["step"]]


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
@pytest.mark.parametrize("ours, torchs", [(ShardLocalAdamW, torch.optim.AdamW), (ShardLocalAdam, torch.optim.Adam)])
def test_shard_local_step_is_bitwise_torchs_on_dtensors(mesh, implementation, ours, torchs):
    ops = []
    local = _train(ours, mesh, implementation, ops)
    reference = _train(torchs, mesh, implementation)
    # the first step creates the two moments of each parameter (zeros_like a DTensor); no update is one
    assert ops == [2 * len(PLACEMENTS), 0, 0], f"DTensor ops in each shard-local step: {ops}"
    assert len(local) == len(reference)
    for a, b in zip(local, reference):
        assert torch.equal(a, b)
    # the update did happen: a no-op step would also be "equal" to nothing
    assert not torch.equal(local[0], _params(mesh, 0)[0].to_local())
