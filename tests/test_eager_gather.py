"""Eager SimpleFSDP gathers without DTensor's redistribute (simple_fsdp.direct_gathers).

Issue #17: on one H200 (fake comm, rank 0 of 8) llama3 8B dp_shard 4 x tp 2 ran eager at 0.60x
torchtitan's eager. Counted on CPU, the step's device work is torchtitan's (same matmul FLOPs, bytes
within a few percent); its host work is not: every parameter read went through a DTensor redistribute,
forward, recompute and regather, and its gradient through another. These tests hold the eager path to
doing without them and to giving, bit for bit, what the redistribute gives.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from graph_trainer.parallel import fake_data
from graph_trainer.parallel.compat import init_fake_process_group
from graph_trainer.parallel.simple_fsdp import MixedPrecision, ParamGather, direct_gathers

RANK, WORLD = 2, 4
"""Rank 2 of a (dp_replicate 1, dp_shard 2, tp 2) mesh: the second dp_shard coordinate, so a chunk taken
from the wrong end of a gather or reduce-scatter shows."""


@pytest.fixture
def mesh():
    init_fake_process_group(WORLD, RANK)
    fake_data.fill_collective_outputs()
    yield init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    fake_data.restore_collectives()
    dist.destroy_process_group()


# storage placements on (dp_replicate, dp_shard, tp), compute placements on tp (None: a plain tensor)
LAYOUTS = {
    "colwise": ((Replicate(), Shard(1), Shard(0)), (Shard(0),), (12, 8)),
    "rowwise": ((Replicate(), Shard(0), Shard(1)), (Shard(1),), (12, 8)),
    "sequence-parallel norm": ((Replicate(), Shard(0), Replicate()), (Replicate(),), (8,)),
    "dp only": ((Replicate(), Shard(0), Replicate()), None, (12, 8)),
}
PRECISIONS = {"bf16 compute, fp32 reduce": MixedPrecision(torch.bfloat16, torch.float32),
              "fp32": MixedPrecision(torch.float32, torch.float32),
              "bf16 compute, bf16 reduce": MixedPrecision(torch.bfloat16, torch.bfloat16)}


def _gather_and_grad(mesh, layout: str, mp: MixedPrecision, direct: bool):
    storage, compute, shape = LAYOUTS[layout]
    torch.manual_seed(0)
    full = torch.randn(shape)
    param = torch.nn.Parameter(distribute_tensor(full, mesh, storage, src_data_rank=None))
    dp_dims = (0, 1)
    gather = ParamGather(dp_dims, None if compute is None else mesh["tp"], compute or (), mp)
    if direct:
        with direct_gathers():
            out = gather(param)
    else:
        out = gather(param)
    local_out = out.to_local() if isinstance(out, DTensor) else out
    upstream = torch.randn(local_out.shape, dtype=local_out.dtype)
    # a gradient that is not uniform over the gathered tensor: each rank's chunk of it differs
    (local_out * upstream).sum().backward()
    return local_out.detach(), param.grad


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_direct_gather_is_bitwise_the_redistribute(mesh, layout, precision):
    mp = PRECISIONS[precision]
    ref_out, ref_grad = _gather_and_grad(mesh, layout, mp, direct=False)
    out, grad = _gather_and_grad(mesh, layout, mp, direct=True)
    assert out.dtype == ref_out.dtype == mp.param_dtype and out.shape == ref_out.shape and out.stride() == ref_out.stride()
    assert torch.equal(out, ref_out)
    assert isinstance(grad, DTensor) and grad.placements == ref_grad.placements and grad.dtype == ref_grad.dtype == torch.float32
    assert grad.to_local().stride() == ref_grad.to_local().stride()
    assert torch.equal(grad.to_local(), ref_grad.to_local())


def test_uneven_shards_keep_the_redistribute(mesh):
    """DTensor pads a dimension the mesh does not divide; the direct gather does not apply there."""
    param = torch.nn.Parameter(distribute_tensor(torch.randn(7, 4), mesh, (Replicate(), Shard(0), Replicate()), src_data_rank=None))
    gather = ParamGather((0, 1), None, (), PRECISIONS["fp32"])
    assert gather._direct_gather(param) is None
    with direct_gathers():
        out = gather(param)
    assert out.shape == (7, 4)


def test_eager_tp_step_reads_no_parameter_through_redistribute(tmp_path, monkeypatch):
    """One eager step of a 2-block debug model, rank 0 of fake dp_shard 2 x tp 2: before the direct gathers
    it called `redistribute` on a parameter 32 times (forward, the checkpointed block's recompute, the
    regathered norm weights; each gradient's reduce-scatter ran in the redistribute's backward besides);
    now never, while the activations' sequence-parallel redistributes stay (the counter counts)."""
    from graph_trainer.config import parse_args
    from graph_trainer.passes.registry import run_teardowns
    from graph_trainer.trainer import GraphTrainer

    cfg = parse_args(["--model.n_layers", "2", "--training.seq_len", "32", "--training.batch_size", "2", "--training.steps", "1",
                      "--training.random_tokens", "--comm.mode", "fake", "--comm.fake_world_size", "4", "--parallelism.dp_shard", "2",
                      "--parallelism.tp", "2", "--activation_checkpoint.mode", "selective", "--compile.mode", "eager",
                      "--job.dump_folder", str(tmp_path)])
    counts = {"parameters": 0, "other": 0}
    redistribute = DTensor.redistribute

    try:
        trainer = GraphTrainer(cfg)
        params = {id(p) for p in trainer.model.parameters()}

        def counting(self, *args, **kwargs):
            counts["parameters" if id(self) in params else "other"] += 1
            return redistribute(self, *args, **kwargs)

        monkeypatch.setattr(DTensor, "redistribute", counting)
        trainer.step = 1
        loss, grad_norm, _ = trainer.train_step()
    finally:
        run_teardowns()
        fake_data.restore_collectives()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert counts["parameters"] == 0 and counts["other"] > 0, counts
    assert torch.isfinite(torch.tensor([loss, grad_norm])).all()
