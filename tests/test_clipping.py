"""Gradient clipping (clipping.py) on local shards equals torchtitan's clip_grad_norm_ on the DTensor
gradients bit for bit, on two gloo ranks whose gradients are really sharded (dp_shard 2; with expert
parallelism, the experts on ep 2): the norm, and every gradient shard after scaling, whether or not the
clip binds; so does the traced step's norm of the shards (`shards_total_norm`). The eager and the traced step
share clipping.py, so their parity cannot catch an error in it. And the traced norm of the shards issues the ops
DTensor's dispatch issues, in its order, on every mesh it takes without DTensor.

The ranks run this file under torchrun (`python -m torch.distributed.run ... tests/test_clipping.py`)."""

from __future__ import annotations

import math
import operator
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.clipping import NORM_CHUNK, clip_grad_norm_, shards_total_norm, total_norm
from graph_trainer.train_step import ParamSpec

MAX_NORMS = (0.5, 1e4, math.inf)
CASES = 2 * len(MAX_NORMS)


def _params(dense, experts, with_experts: bool) -> list[DTensor]:
    """Every third parameter on the expert mesh with expert parallelism (without it one mesh holds
    all); odd row counts shard unevenly over the two ranks. More than `NORM_CHUNK` of them on one
    mesh: the norms are taken a chunk at a time."""
    g = torch.Generator().manual_seed(0)
    params = []
    for i in range(2 * NORM_CHUNK + 9):
        expert = with_experts and i % 3 == 0
        mesh, placements = (experts, [Replicate(), Shard(0)]) if expert else (dense, [Replicate(), Shard(0), Replicate()])
        shape = (7 + i % 2, 5 + i % 11)
        p = distribute_tensor(torch.randn(shape, generator=g), mesh, placements)
        p.grad = distribute_tensor(torch.randn(shape, generator=g) * (i + 1), mesh, placements)
        params.append(p)
    return params


def _specs(params: list[DTensor]) -> list[ParamSpec]:
    return [ParamSpec(f"p{i}", p.device_mesh, tuple(p.placements), p.shape, p.stride()) for i, p in enumerate(params)]


def _check_every_case() -> int:
    from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip_grad_norm_

    dense = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    experts = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    checked = 0
    for ep_enabled in (False, True):
        for max_norm in MAX_NORMS:
            ours, theirs = _params(dense, experts, ep_enabled), _params(dense, experts, ep_enabled)
            assert all(p.grad.to_local().numel() < p.grad.numel() for p in ours), "every gradient is sharded over the ranks"
            full = torch.cat([p.grad.full_tensor().flatten() for p in ours])
            before = [p.grad.to_local().clone() for p in ours]
            traced_norm = shards_total_norm(_specs(ours), before, ep_enabled)
            norm = clip_grad_norm_(ours, max_norm, ep_enabled)
            want = titan_clip_grad_norm_(theirs, max_norm, foreach=True, ep_enabled=ep_enabled)
            assert not isinstance(norm, DTensor) and torch.equal(norm, want), (ep_enabled, max_norm, norm, want)
            assert torch.equal(traced_norm, want), (ep_enabled, max_norm, traced_norm, want)
            # Both against the norm of the whole gradient: only the summation order differs (fp32, ~3,100).
            assert math.isclose(norm.item(), full.norm().item(), rel_tol=1e-6), (norm, full.norm())
            assert all(torch.equal(a.grad.to_local(), b.grad.to_local()) for a, b in zip(ours, theirs))
            scaled = [not torch.equal(p.grad.to_local(), b) for p, b in zip(ours, before)]
            # the norm of these gradients is ~3,100: a max_norm of 0.5 scales every one, 1e4 and inf none
            assert all(scaled) if max_norm == 0.5 else not any(scaled)
            checked += 1
    return checked


def test_equals_torchtitans_clip_bit_for_bit_on_two_ranks():
    from helpers import ranks_report

    assert ranks_report("test_clipping.py") == [f"rank{r}:{CASES}" for r in (0, 1)]


def _ops(gm: torch.fx.GraphModule) -> list[tuple]:
    """The graph's ops that compute something read, in order, each argument named by what it computes: views and
    getitems stand for what they read, and ops whose results nothing reads are left out (DTensor's trace leaves a
    `_foreach_norm` of the global shapes' empty tensors)."""
    read = {n for n in gm.graph.nodes if n.users or n.op == "output"}
    changed = True
    while changed:
        changed = False
        for n in list(read):
            if n.op == "call_function" and n.users and all(u not in read for u in n.users):
                read.discard(n)
                changed = True
    names: dict[torch.fx.Node, object] = {}
    ops = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            names[n] = ("input", len(names))
        elif n.op == "call_function" and n in read:
            args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: names[a])
            if n.target is operator.getitem:
                names[n] = (args[0][0], args[0][1])
            elif isinstance(n.target, torch._ops.OpOverload) and n.target.is_view:
                names[n] = args[0][0]
            else:
                names[n] = ("op", len(ops))
                ops.append((str(n.target), args))
    return ops


@pytest.mark.parametrize("shape, placements, plain", [
    ((1, 4, 1), (Replicate(), Shard(0), Replicate()), True),  # FSDP, as the trainer's dense mesh places it
    ((2, 2, 1), (Replicate(), Shard(0), Replicate()), True),  # HSDP
    ((1, 4, 1), (Replicate(), Replicate(), Replicate()), True),
    ((1, 4, 1), (Shard(0), Replicate(), Shard(1)), True),  # sharded along dimensions of one rank only: no reduction
    ((1, 2, 2), (Replicate(), Shard(0), Shard(1)), False),  # sharded along two dimensions: through DTensor
])
def test_traced_norm_of_the_shards_issues_dtensors_ops(shape, placements, plain):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        params = [distribute_tensor(torch.randn(12 + i % 3, 8), mesh, placements) for i in range(NORM_CHUNK + 5)]
        specs = _specs(params)
        local = [p.to_local() for p in params]
        through_dtensor = make_fx(lambda *g: total_norm([s.wrap(x) for s, x in zip(specs, g)], False))(*local)
        ours = make_fx(lambda *g: shards_total_norm(specs, g, False))(*local)
        assert _ops(ours) == _ops(through_dtensor)
        assert any("all_reduce" in op for op, _ in _ops(ours)) == any(isinstance(p, Shard) and n > 1 for p, n in zip(placements, shape))
        # without DTensor the trace holds no view of a shard and no op on global shapes
        assert (len(ours.graph.nodes) < len(through_dtensor.graph.nodes)) == plain
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    # one write per rank: both ranks share the pipe, and print's separate newline write can interleave
    sys.stdout.write(f"rank{dist.get_rank()}:{_check_every_case()}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
