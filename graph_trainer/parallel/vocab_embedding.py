"""The token embedding read where it is stored: each data-parallel rank looks up every rank's tokens in its own rows.

SimpleFSDP gathers a parameter where a module reads it and reduce-scatters its gradient. For the token embedding
that moves the whole table (vocab x dim) twice a step, at the two ends of the step where no compute can hide it: the
first gather runs before the first block, the last reduction after the last backward op. On 2 x H200, llama3 8B cut to
16 layers at dp_shard 2, they were 2.6 and 7.8 ms of the 12.3 ms of exposed communication in a 486 ms step
(bench/results/2026-11-29-session20, call 1).

Here the table stays sharded by rows over `dp_shard` (the storage, checkpoints and optimizer are SimpleFSDP's). In
forward the ranks' token ids are all-gathered (8 bytes a token); each rank looks them up in its rows, zeroes the
tokens outside them, and the embeddings are reduce-scattered (summed) back to the ranks whose tokens they are. In
backward the embeddings' gradients are all-gathered and each rank accumulates its rows' gradient from every rank's
tokens, in the reduce dtype, averaged over the ranks as SimpleFSDP's `Partial("avg")` does (and all-reduced over
`dp_replicate`, HSDP's replicas, as there). That moves n x tokens x dim activations in place of vocab x dim weights:
fewer bytes while n x tokens a rank < vocab.

Gradients equal SimpleFSDP's up to the order of the sums (a row's contributions summed over all ranks' tokens in one
pass, against each rank's sum then the reduction across ranks); eager and traced steps run the same ops and match
bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from .compat import all_gather_single, all_reduce_single, reduce_scatter_single
from .mesh import Degrees
from .simple_fsdp import MixedPrecision

MODULE = "tok_embeddings"


def unsupported(degrees: Degrees, vocab: int, autoparallel: bool) -> str | None:
    """Why `--parallelism.embedding vocab` cannot run on this job (None: it can)."""
    if autoparallel:
        return "the solver places the embedding itself (--compile.autoparallel)"
    if degrees.dp_shard < 2:
        return "it shards over dp_shard, which is 1"
    if degrees.tp > 1:
        return f"tp {degrees.tp} shards the embedding's rows itself (tensor parallelism's vocab-parallel lookup)"
    if vocab % degrees.dp_shard:
        return f"the vocabulary ({vocab}) does not split evenly over dp_shard {degrees.dp_shard}"
    return None


def chosen(choice: str, degrees: Degrees, vocab: int, tokens_per_rank: int, autoparallel: bool, device_type: str) -> bool:
    """`--parallelism.embedding`: `vocab`, `gather`, or auto: vocab on GPUs where it moves fewer bytes (the ranks'
    tokens fewer than the vocabulary's rows). CPU keeps SimpleFSDP's gather, which gloo runs bit for bit like
    torchtitan's FSDP2."""
    if choice != "auto":
        return choice == "vocab"
    return (device_type == "cuda" and unsupported(degrees, vocab, autoparallel) is None
            and degrees.dp_shard * tokens_per_rank < vocab)


class _LookUpOwnRows(torch.autograd.Function):
    """Every rank's tokens looked up in this rank's rows, summed back to their ranks (forward); the rows' gradient
    from every rank's tokens (backward)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, tokens: torch.Tensor, group: tuple, replicas: tuple | None,
                mp: MixedPrecision) -> torch.Tensor:
        mesh, mesh_dim = group
        count = rows.shape[0]
        ids = all_gather_single(tokens.contiguous(), 0, group) - mesh.get_local_rank(mesh_dim) * count
        owned = (ids >= 0) & (ids < count)
        ids = torch.where(owned, ids, 0)
        found = torch.where(owned.unsqueeze(-1), F.embedding(ids, rows.to(mp.param_dtype)), 0)
        ctx.save_for_backward(ids, owned)
        ctx.group, ctx.replicas, ctx.count, ctx.ranks = group, replicas, count, mesh.size(mesh_dim)
        ctx.reduce_dtype, ctx.param_dtype = mp.reduce_dtype, rows.dtype
        return reduce_scatter_single(found, "sum", 0, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        ids, owned = ctx.saved_tensors
        grads = all_gather_single(grad.contiguous(), 0, ctx.group).to(ctx.reduce_dtype)
        grads = torch.where(owned.unsqueeze(-1), grads, 0)
        mean = torch.ops.aten.embedding_dense_backward(grads, ids, ctx.count, -1, False) / ctx.ranks
        if ctx.replicas is not None:
            mean = all_reduce_single(mean, "avg", ctx.replicas)
        return mean.to(ctx.param_dtype), None, None, None, None


class VocabShardedEmbedding(nn.Embedding):
    """An `nn.Embedding` whose weight is SimpleFSDP's storage (sharded by rows over `dp_shard`), read in place."""

    _group: tuple
    _replicas: tuple | None
    """(mesh, mesh dim) of dp_shard, and of dp_replicate where it has several ranks."""
    _mp: MixedPrecision

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _LookUpOwnRows.apply(self.weight.to_local(), tokens, self._group, self._replicas, self._mp)


def read_in_place(model: nn.Module, mp: MixedPrecision) -> None:
    """Make the model's token embedding, already under SimpleFSDP, a `VocabShardedEmbedding` (a pipeline rank whose
    stages hold none has nothing to change)."""
    module = getattr(model, MODULE, None)
    if module is None:
        return
    assert type(module).__mro__[1] is nn.Embedding, type(module)
    weight = module._parameters["weight"]
    mesh = weight.device_mesh
    dim, replicas = mesh.mesh_dim_names.index("dp_shard"), mesh.mesh_dim_names.index("dp_replicate")
    assert weight.placements[dim] == Shard(0), weight.placements
    del module._fsdp_gathers
    module.__class__ = VocabShardedEmbedding
    module._group, module._mp = (mesh, dim), mp
    module._replicas = (mesh, replicas) if mesh.size(replicas) > 1 else None
