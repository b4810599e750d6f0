"""What collectives return under `--comm.mode fake` (graph_trainer/parallel/fake_data.py).

torch 2.11's fake process group leaves a reduce-scatter's and an all-to-all's output as allocated
(measured on the GPU machine: bench/results/2026-11-24-fake-data-check.json), and a step that goes NaN
runs GEMMs at higher clocks than a real one. The kernels fill those outputs from the rank's own input;
these tests hold them to torch 2.13's fake group where it copies (reduce-scatter: the rank's chunk;
all-gather: the input repeated), and to returning the input where it does not copy (all-to-all).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from graph_trainer.parallel import fake_data
from graph_trainer.parallel.compat import init_fake_process_group

RANK, WORLD = 2, 4
ops = torch.ops._c10d_functional


@pytest.fixture
def fake_group():
    init_fake_process_group(WORLD, RANK)
    yield dist.group.WORLD.group_name
    fake_data.restore_collectives()
    dist.destroy_process_group()


def _outputs(group: str, x: torch.Tensor) -> list[torch.Tensor]:
    wait = ops.wait_tensor
    return [wait(ops.reduce_scatter_tensor(x, "sum", WORLD, group)), wait(ops.reduce_scatter_tensor(x, "avg", WORLD, group)),
            wait(ops.all_gather_into_tensor(x, WORLD, group)), *[wait(t) for t in ops.reduce_scatter_tensor_coalesced([x, 2 * x], "sum", WORLD, group)]]


def test_reduce_scatter_and_all_gather_fill_outputs_as_torchs_copying_fake_group(fake_group):
    x = torch.randn(8, 3)
    torchs = _outputs(fake_group, x)
    fake_data.fill_collective_outputs()
    ours = _outputs(fake_group, x)
    own = x[RANK * 2 : RANK * 2 + 2]
    assert torch.equal(ours[0], own) and torch.equal(ours[2], x.repeat(WORLD, 1)) and torch.equal(ours[4], 2 * own)
    if torch.__version__ >= "2.13":  # this torch's own fake group copies: ours must give the same values
        assert all(torch.equal(a, b) for a, b in zip(torchs, ours))


def test_all_to_all_returns_the_input_through_the_autograd_variant_too(fake_group):
    fake_data.fill_collective_outputs()
    x = torch.randn(8, 3)
    assert torch.equal(ops.wait_tensor(ops.all_to_all_single(x, [2] * WORLD, [2] * WORLD, fake_group)), x)
    y = x.clone().requires_grad_()
    out = funcol.all_to_all_single_autograd(y, None, None, dist.group.WORLD)
    assert torch.equal(funcol.wait_tensor(out), x)
    uneven = ops.wait_tensor(ops.all_to_all_single(x, [1, 1, 1, 2], [2] * WORLD, fake_group))
    assert torch.equal(uneven, x[:5])


def test_stale_memory_is_never_returned(fake_group):
    """A reduce-scatter written out of place into a buffer holding NaN (stale memory) returns data."""
    fake_data.fill_collective_outputs()
    x = torch.randn(8, 3)
    out = torch.full((2, 3), float("nan"))
    ops.reduce_scatter_tensor_out(x, "sum", WORLD, fake_group, out=out)
    assert torch.equal(out, x[RANK * 2 : RANK * 2 + 2])


def test_dtensor_shard_to_shard_of_a_gpu_mesh_gives_what_the_cpu_mesh_gives(fake_group):
    """DTensor's Shard(0) -> Shard(2) is `_dtensor.shard_dim_alltoall` on a GPU mesh (an all-to-all into
    `empty_like`, stale on torch 2.11's fake group: the auto-placed 8B run went NaN from step 1) and an
    all-gather then the rank's chunk on a CPU mesh. With uninitialised memory filled with NaN, the op
    must return, bitwise, the CPU path's values: the rank's chunk along dim 2, repeated along dim 0."""
    fake_data.fill_collective_outputs()
    mesh = DeviceMesh("cpu", list(range(WORLD)))
    x = torch.randn(2, 3, 4 * WORLD)
    on_cpu_mesh = DTensor.from_local(x, mesh, [Shard(0)], run_check=False).redistribute(mesh, [Shard(2)]).to_local()
    was = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        on_gpu_path = torch.ops._dtensor.shard_dim_alltoall(x, 0, 2, fake_group)
    finally:
        torch.use_deterministic_algorithms(was[0])
        torch.utils.deterministic.fill_uninitialized_memory = was[1]
    own = x[:, :, RANK * 4 : RANK * 4 + 4]
    assert torch.equal(on_cpu_mesh, own.repeat(WORLD, 1, 1))
    assert torch.equal(on_gpu_path, on_cpu_mesh)


def test_vocab_parallel_embedding_gives_the_real_rows_once_tokens_are_in_the_rank_shard(fake_group):
    """TP's vocab-parallel embedding zeroes the rows of tokens outside the rank's vocabulary shard and
    a real reduce-scatter over `tp` fills them from the rank that holds them; the fake one keeps them
    zero (at llama3 8B sizes the gradients then overflow to NaN). With the tokens moved into the
    rank's shard, the looked-up rows are, bitwise, those of the full embedding table."""
    fake_data.fill_collective_outputs()
    mesh = DeviceMesh("cpu", list(range(WORLD)), mesh_dim_names=("tp",))
    table = torch.randn(30, 4)  # 30 rows over 4 ranks: 8, 8, 8, 6, so rank 2 holds rows 16 to 23
    weight = DTensor.from_local(table[16:24], mesh, [Shard(0)], run_check=False, shape=table.shape, stride=table.stride())
    tokens = (torch.arange(8 * WORLD) * 7 % 30).view(2, 4 * WORLD)  # this rank's positions hold rows 26, 3, 10, 17 and 18, 25, 2, 9

    def looked_up(t: torch.Tensor) -> torch.Tensor:
        ids = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        return torch.nn.functional.embedding(ids, weight).redistribute(mesh, [Shard(1)]).to_local()

    zero_rows = (looked_up(tokens) == 0).all(-1)
    assert zero_rows.any() and not zero_rows.all()
    moved = fake_data.tokens_in_vocab_shard(tokens, weight)
    assert bool(((moved >= 16) & (moved < 24)).all())
    assert torch.equal(looked_up(moved), table[moved].chunk(WORLD, 1)[RANK])
    # another layout (replicated, or no DTensor) keeps the tokens
    assert torch.equal(fake_data.tokens_in_vocab_shard(tokens, DTensor.from_local(table, mesh, [Replicate()], run_check=False)), tokens)
    assert torch.equal(fake_data.tokens_in_vocab_shard(tokens, table), tokens)


def test_restore_gives_torch_its_kernels_back(fake_group, monkeypatch):
    """Our kernels are spied on: after the restore no collective may reach them. (Comparing outputs
    cannot tell: torch 2.13's fake group copies the same chunk our reduce-scatter kernel does.)"""
    calls: list[str] = []

    def spied(name, kernel):
        def kernel_and_record(*args, **kwargs):
            calls.append(name)
            return kernel(*args, **kwargs)

        return kernel_and_record

    monkeypatch.setattr(fake_data, "_KERNELS", {ns: {name: spied(name, k) for name, k in kernels.items()}
                                                for ns, kernels in fake_data._KERNELS.items()})
    x = torch.randn(8, 3)

    def every_collective() -> None:
        _outputs(fake_group, x)
        ops.reduce_scatter_tensor_out(x, "sum", WORLD, fake_group, out=torch.empty(2, 3))
        ops.all_gather_into_tensor_out(x, WORLD, fake_group, out=torch.empty(32, 3))
        ops.wait_tensor(ops.all_to_all_single(x, [2] * WORLD, [2] * WORLD, fake_group))

    fake_data.fill_collective_outputs()
    every_collective()
    assert set(calls) == {"reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_gather_into_tensor",
                          "reduce_scatter_tensor_out", "all_gather_into_tensor_out", "all_to_all_single"}
    calls.clear()
    fake_data.restore_collectives()
    every_collective()
    assert calls == []
    assert not fake_data._libraries
