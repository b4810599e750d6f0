"""The token embedding read in place (`--parallelism.embedding vocab`, parallel/vocab_embedding.py).

On two gloo ranks the module gives each rank exactly its tokens' rows of the whole table and each rank's rows exactly
their averaged gradient over both ranks' tokens (integer-valued gradients: every sum exact, so the order of the sums
cannot hide an error), in fp32 and in bf16 compute with fp32 reduction. The traced step moves token ids and
embeddings where SimpleFSDP moves the table; training with it equals eager bit for bit, and SimpleFSDP's gather to
within the rounding of the reordered sums.

The module check runs this file under torchrun (`python -m torch.distributed.run ... tests/test_vocab_embedding.py`)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed.tensor import DTensor

from graph_trainer.parallel.mesh import Degrees, build_meshes
from graph_trainer.parallel.simple_fsdp import MixedPrecision, apply_simple_fsdp
from graph_trainer.parallel.vocab_embedding import VocabShardedEmbedding, chosen, read_in_place

VOCAB, DIM, BATCH, SEQ = 24, 5, 3, 7
PRECISIONS = (MixedPrecision(torch.float32, torch.float32), MixedPrecision(torch.bfloat16, torch.float32))


def _rank_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's tokens (repeats, both halves of the vocabulary) and an integer-valued gradient of its embeddings."""
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tokens[0, :3] = torch.tensor([0, VOCAB - 1, 0])
    return tokens, torch.randint(-4, 5, (BATCH, SEQ, DIM), generator=g).float()


def _check_on_two_ranks() -> int:
    meshes = build_meshes(Degrees(1, 2, 1, 1), "cpu")
    rank = dist.get_rank()
    table = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(0))
    checked = 0
    for mp in PRECISIONS:
        model = nn.Module()
        model.tok_embeddings = nn.Embedding(VOCAB, DIM, device="meta")
        apply_simple_fsdp(model, meshes, mp)
        stored = model.tok_embeddings._parameters["weight"]
        rows = table.chunk(2)[rank].clone()
        model.tok_embeddings._parameters["weight"] = nn.Parameter(DTensor.from_local(rows, stored.device_mesh, stored.placements))
        read_in_place(model, mp)
        assert type(model.tok_embeddings) is VocabShardedEmbedding

        tokens, grad = _rank_inputs(rank)
        out = model.tok_embeddings(tokens)
        assert out.dtype == mp.param_dtype and torch.equal(out, F.embedding(tokens, table.to(mp.param_dtype))), (mp, rank)
        out.backward(grad.to(out.dtype))
        # SimpleFSDP's gradient: each rank's, averaged over the ranks, this rank's rows
        whole = sum(torch.ops.aten.embedding_dense_backward(g, t, VOCAB, -1, False) for t, g in map(_rank_inputs, (0, 1))) / 2
        got = model.tok_embeddings.weight.grad
        assert isinstance(got, DTensor) and got.placements == stored.placements
        assert torch.equal(got.to_local(), whole.chunk(2)[rank]), (mp, rank)
        checked += 1
    return checked


def test_each_rank_gets_its_tokens_rows_and_its_rows_gradient_bit_for_bit_on_two_ranks():
    from helpers import ranks_report

    assert ranks_report("test_vocab_embedding.py") == [f"rank{r}:{len(PRECISIONS)}" for r in (0, 1)]


@pytest.fixture
def fake_pg():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _collectives(gm: fx.GraphModule) -> list[tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...]]]:
    """(op, dtype, input shape, output shape) of each collective, in graph order."""
    ops = {torch.ops._c10d_functional.all_gather_into_tensor.default: "all_gather",
           torch.ops._c10d_functional.reduce_scatter_tensor.default: "reduce_scatter"}
    return [(ops[n.target], n.meta["val"].dtype, tuple(n.args[0].meta["val"].shape), tuple(n.meta["val"].shape))
            for n in gm.graph.nodes if n.target in ops]


def test_the_traced_step_moves_token_ids_and_embeddings_not_the_table(fake_pg):
    from traced_step import SEQ_LEN, trace_step

    from graph_trainer.passes.block_bucketing import transformer_block_bucketing

    gathered, _ = trace_step("llama3", 2, 1, 1)
    in_place, ctx = trace_step("llama3", 2, 1, 1, "--parallelism.embedding", "vocab")
    vocab, dim = 2048, 256
    local = 4 // 2
    def table(gm):  # the embedding's and the output projection's weights: vocab x dim
        return [c[0] for c in _collectives(gm) if (vocab, dim) in (c[2], c[3])]

    # SimpleFSDP: both tables gathered in forward and their gradients reduce-scattered in backward, the embedding's
    # first and last; read in place, the output projection's alone
    assert table(gathered) == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]
    assert _collectives(gathered)[0][3] == (vocab, dim) and _collectives(gathered)[-1][2] == (vocab, dim)
    assert table(in_place) == ["all_gather", "reduce_scatter"]
    moved = _collectives(in_place)
    ids, embeddings, grads = (("all_gather", torch.long, (local, SEQ_LEN), (2 * local, SEQ_LEN)),
                              ("reduce_scatter", torch.float32, (2 * local, SEQ_LEN, dim), (local, SEQ_LEN, dim)),
                              ("all_gather", torch.float32, (local, SEQ_LEN, dim), (2 * local, SEQ_LEN, dim)))
    assert moved[:2] == [ids, embeddings] and moved[-1] == grads
    assert len(moved) == len(_collectives(gathered)) + 1
    # the default overlap schedule takes the graph (the ids' gather is a graph input's, as a parameter's is)
    transformer_block_bucketing(in_place, ctx)


@pytest.mark.parametrize("device, tokens, expected", [("cuda", 8192, True), ("cpu", 8192, False), ("cuda", 65536, False)])
def test_auto_reads_in_place_on_gpus_where_it_moves_fewer_bytes(device, tokens, expected):
    # llama3's 128,256 rows at dp_shard 2: 2 x 8,192 tokens move fewer bytes, 2 x 65,536 more
    assert chosen("auto", Degrees(1, 2, 1, 1), 128256, tokens, False, device) is expected
    assert not chosen("auto", Degrees(1, 2, 2, 1), 128256, tokens, False, device)
    assert not chosen("auto", Degrees(1, 2, 1, 1), 128256, tokens, True, device)
    assert chosen("vocab", Degrees(1, 2, 1, 1), 128256, tokens, False, device)
    assert not chosen("gather", Degrees(1, 2, 1, 1), 128256, tokens, False, device)


@pytest.mark.parametrize("ranks, mesh", [(2, ("--parallelism.dp_shard", "2")),
                                         (4, ("--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2")),
                                         (4, ("--parallelism.pp", "2", "--parallelism.dp_shard", "2"))],
                         ids=["dp_shard 2", "HSDP 2 x 2", "pp 2 x dp_shard 2"])
def test_training_with_it_equals_eager_bit_for_bit_and_simple_fsdp_within_rounding(ranks, mesh):
    # HSDP: the rows' gradient all-reduced over the replicas too; pp: the first stage looks up each microbatch
    from helpers import cached_train, grad_norms, losses

    base = (*mesh, "--training.batch_size", str(2 * ranks), "--training.seq_len", "64", "--model.n_layers", "2",
            "--training.steps", "4", "--training.deterministic", "--metrics.log_freq", "1")
    vocab = ("--parallelism.embedding", "vocab")
    traced = cached_train(base + vocab, nproc=ranks)
    eager = cached_train(base + vocab + ("--compile.mode", "eager"), nproc=ranks)
    gathered = cached_train(base + ("--parallelism.embedding", "gather"), nproc=ranks)
    assert losses(traced) == losses(eager) and grad_norms(traced) == grad_norms(eager)
    # the embedding's gradient summed in another order (fp32): a few units in the last place of the loss
    for a, b in ((losses(traced), losses(gathered)), (grad_norms(traced), grad_norms(gathered))):
        assert a != [] and all(abs(x - y) <= 1e-6 * abs(y) for x, y in zip(a, b, strict=True)), (a, b)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    sys.stdout.write(f"rank{dist.get_rank()}:{_check_on_two_ranks()}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
