"""`--training.dtype bfloat16`: parameters, gradients and optimizer states stored in bf16 (torchtitan's
`--training.dtype`, its only bf16 training on a mesh of TP or PP without FSDP), the rotary tables still fp32; eager and
traced steps equal bit for bit on meshes with and without FSDP."""

from __future__ import annotations

import pytest
import torch

from helpers import cached_train, grad_norms, losses


def test_parameters_gradients_and_optimizer_states_are_stored_in_bf16(tmp_path):
    from graph_trainer.config import JobConfig
    from graph_trainer.trainer import GraphTrainer

    cfg = JobConfig()
    cfg.training.batch_size, cfg.training.seq_len, cfg.training.dtype = 2, 32, "bfloat16"
    cfg.model.n_layers, cfg.job.dump_folder = 2, str(tmp_path)
    trainer = GraphTrainer(cfg)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in trainer.model.buffers()} == {torch.complex64}
    loss, _, _ = trainer.train_step()
    assert torch.isfinite(torch.tensor(loss))
    assert {p.grad.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    states = [v for opt in trainer.optimizers.optimizers for s in opt.state.values() for v in s.values() if v.ndim]
    assert states and {v.dtype for v in states} == {torch.bfloat16}


@pytest.mark.parametrize("mesh", [("--parallelism.dp_shard", "2"), ("--parallelism.dp_shard", "1", "--parallelism.tp", "2")],
                         ids=["dp_shard 2", "tp 2"])
def test_traced_equals_eager_bit_for_bit_in_bf16_on_two_ranks(mesh):
    base = ("--training.dtype", "bfloat16", "--training.steps", "3", "--training.deterministic", "--metrics.log_freq", "1", *mesh)
    traced = cached_train(base, nproc=2)
    eager = cached_train(base + ("--compile.mode", "eager"), nproc=2)
    assert len(losses(traced)) == 3
    assert losses(traced) == losses(eager) and grad_norms(traced) == grad_norms(eager)
