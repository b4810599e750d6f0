"""What a collective's output holds on the fake process group: the rank's own data, never stale memory.

torch's fake process group moves no data, and on torch 2.11 (the GPU machines) its reduce-scatter and
all-to-all leave their outputs as allocated: stale memory that soon makes activations and gradients
NaN. That is not harmless for a benchmark of compute: measured on an H200, a bf16 GEMM of NaNs runs
at 783 TFLOP/s against 662 for random values (the power-limited GPU clocks up from about 1460 to
1740 MHz; bench/results/2026-11-24-fake-data-check.json), so a fake run that went NaN looks up to
1.18x faster than the real job would.

Here the functional collectives every traced and eager path of this package calls get kernels that
fill their outputs from the rank's input: a reduce-scatter returns the rank's chunk of it (what an
average over ranks holding the same data gives; torch 2.13's fake group does the same), an all-gather
repeats it (as both torch versions do), an all-to-all returns it (the rank's own tokens, in slots of
the sizes asked for). Shapes, dtypes and one device copy per collective are what a real collective
gives; values stay those of a training step.

DTensor's Shard(i) -> Shard(j) on a GPU mesh is not a functional collective: it is
`_dtensor.shard_dim_alltoall`, which allocates its output with `empty_like` and hands it to the
process group's all-to-all, so on torch 2.11's fake group it returns stale memory. Auto-placed
steps use it wherever the solver moves an activation from batch to hidden sharding; on a CPU mesh
DTensor takes an all-gather and a chunk instead, which is why only the GPU runs went NaN. Its kernel
here gives what that CPU path gives with the all-gather above: the rank's chunk along the shard
dimension, repeated along the gather dimension, so the values of a fake step are the same on both.

A reduce-scatter of partial sums that are not alike on every rank is the one place where "the rank's
own data" is not what a real collective gives: the vocab-parallel embedding of tensor parallelism
(DTensor's `_MaskPartial`) zeroes the rows of tokens outside the rank's vocabulary shard and lets the
sum over `tp` fill them from the rank that holds them. On the fake group those rows stay zero, the
residual stream of half the tokens starts at zero, and every RMSNorm's backward scales their gradient
by about 1/sqrt(eps) while the residual stays small: measured on CPU (fake dp_shard 4 x tp 2), the
step-1 gradient norm grows about 100x a layer back through llama3 8B's dimensions and reaches inf at
32 layers of the debug model; the 8B dp_shard 4 x tp 2 fake runs went NaN on the GPU. torchtitan's fake
tp run has the same zero rows and stays finite, we infer because FSDP2 reduce-scatters its gradients
through the process group, whose stale output, not these gradients, reaches its weights. So a fake
step's input tokens are moved into the rows the rank holds (`tokens_in_vocab_shard`): every embedding
row is then what the real reduce-scatter returns, bitwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Shard

_KERNEL_KEYS = ("CPU", "CUDA")
_libraries: list[torch.library.Library] = []


def _rank_in(group_name: str) -> int:
    return dist.get_rank(_resolve_process_group(group_name))


def _own_chunk(inp: torch.Tensor, group_size: int, group_name: str, dim: int = 0) -> torch.Tensor:
    return inp.chunk(group_size, dim)[_rank_in(group_name)]


def _reduce_scatter(inp: torch.Tensor, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    return _own_chunk(inp, group_size, group_name).clone(memory_format=torch.contiguous_format)


def _reduce_scatter_out(inp: torch.Tensor, reduce_op: str, group_size: int, group_name: str, *, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(_own_chunk(inp, group_size, group_name))


def _reduce_scatter_coalesced(inputs: list[torch.Tensor], reduce_op: str, group_size: int, group_name: str) -> list[torch.Tensor]:
    return [_reduce_scatter(t, reduce_op, group_size, group_name) for t in inputs]


def _all_gather(inp: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return inp.repeat(group_size, *[1] * (inp.dim() - 1)) if inp.dim() else inp.repeat(group_size)


def _all_gather_out(inp: torch.Tensor, group_size: int, group_name: str, *, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(_all_gather(inp, group_size, group_name))


def _all_gather_coalesced(inputs: list[torch.Tensor], group_size: int, group_name: str) -> list[torch.Tensor]:
    return [_all_gather(t, group_size, group_name) for t in inputs]


def _all_to_all(inp: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group_name: str) -> torch.Tensor:
    rows = sum(output_split_sizes) if output_split_sizes else inp.shape[0]
    if rows == inp.shape[0]:
        return inp.clone(memory_format=torch.contiguous_format)
    # uneven slots (dynamic splits): each output row repeats an input row, cycling
    index = torch.arange(rows, device=inp.device) % max(inp.shape[0], 1)
    return inp.index_select(0, index) if inp.shape[0] else inp.new_zeros((rows, *inp.shape[1:]))


def _shard_dim_alltoall(inp: torch.Tensor, gather_dim: int, shard_dim: int, group_name: str) -> torch.Tensor:
    group_size = _resolve_process_group(group_name).size()
    own = _own_chunk(inp, group_size, group_name, shard_dim)
    return own.repeat(*[group_size if d == gather_dim else 1 for d in range(own.dim())])


_KERNELS = {
    "_c10d_functional": {
        "reduce_scatter_tensor": _reduce_scatter,
        "reduce_scatter_tensor_out": _reduce_scatter_out,
        "reduce_scatter_tensor_coalesced": _reduce_scatter_coalesced,
        "all_gather_into_tensor": _all_gather,
        "all_gather_into_tensor_out": _all_gather_out,
        "all_gather_into_tensor_coalesced": _all_gather_coalesced,
        "all_to_all_single": _all_to_all,
    },
    "_dtensor": {"shard_dim_alltoall": _shard_dim_alltoall},
}
"""Op namespace -> op name -> the kernel that fills its output."""


def tokens_in_vocab_shard(tokens: torch.Tensor, embedding_weight: torch.Tensor, dims: tuple[str, ...] = ("tp",)) -> torch.Tensor:
    """`tokens` moved into the vocabulary rows this rank holds of an embedding weight sharded by rows
    on one of the mesh dimensions `dims` it is looked up over (token % held rows + first held row): `tp`, and
    `dp_shard` where the embedding is read in place (vocab_embedding.py, whose sum over the ranks is the same
    reduce-scatter); unchanged for any other layout."""
    if not isinstance(embedding_weight, DTensor):
        return tokens
    mesh = embedding_weight.device_mesh
    for mesh_dim, (name, placement) in enumerate(zip(mesh.mesh_dim_names, embedding_weight.placements)):
        if name in dims and placement == Shard(0):
            shards, shard = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
            rows, first = Shard.local_shard_size_and_offset(embedding_weight.shape[0], shards, shard)
            # a rank past the end of an uneven split holds no row: no token can be its own there
            return tokens % rows + first if rows else tokens
    return tokens


def fill_collective_outputs() -> None:
    """Give the collectives the kernels above (process-wide; idempotent). Only for a process on
    the fake process group: a real collective must not be replaced."""
    if _libraries:
        return
    for namespace, kernels in _KERNELS.items():
        library = torch.library.Library(namespace, "IMPL")
        for name, kernel in kernels.items():
            for key in _KERNEL_KEYS:
                library.impl(name, kernel, key)
        _libraries.append(library)


def restore_collectives() -> None:
    """Undo `fill_collective_outputs` (before a real process group is made in this process)."""
    while _libraries:
        _libraries.pop()._destroy()


class _RandomGrad(torch.autograd.Function):
    """Identity forward; backward: a random gradient in place of the one a real next stage would send."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.randn_like(grad)


class FakeNeighbours(torch.nn.Module):
    """A pipeline stage of a fake run (`--comm.mode fake` with pp): the neighbouring stages' ranks are not there,
    so the P2P receives of its input activations and of its output gradients move no data and leave the
    schedule's buffers as allocated. A stage that receives its input fills it with random values, and one that
    sends its output on gets a random gradient for it: finite, non-degenerate operands for its kernels, as
    `fill_collective_outputs` gives the collectives."""

    def __init__(self, stage: torch.nn.Module, first: bool, last: bool):
        super().__init__()
        self.stage, self.first, self.last = stage, first, last
        if hasattr(stage, "dw_builder"):
            self.dw_builder = stage.dw_builder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.first:
            with torch.no_grad():
                x.normal_()
        out = self.stage(x)
        return out if self.last else _RandomGrad.apply(out)
