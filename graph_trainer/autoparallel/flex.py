"""FlexAttention for the solver: the block mask as per-batch inputs, the op's declared strategies,
and its per-rank run.

A FlexAttention model builds its BlockMask from each batch's token ids (models.install_attention_masks:
document boundaries), outside its blocks. A block traced with that mask as constants would keep the
documents of the traced batch, so the mask's tensors (kv_num_blocks, kv_indices, ... and the tensors
its mask function reads, such as the document index of every token) are traced as inputs of the
block instead, and at run time each block reads them from the mask the model built for that batch.

Each rank builds the mask of its own tokens, so a mask tensor indexed by sequence (first dim the
batch) is the batch shard of the global mask, laid out like the tokens; one shared by all sequences
(first dim 1: a causal mask) is the same on every rank, replicated.

The op (`flex_attention`, a higher-order op DTensor has no strategy for) gets declared strategies,
per solver mesh dim, as SDPA has from DTensor:

  | choice on a mesh dim | q, k, v | mask tensors indexed by sequence | other mask tensors | output, logsumexp |
  |---|---|---|---|---|
  | `replicate` | R | R | R | R |
  | `batch` | S(0) | S(0) | R | S(0) |
  | `heads` | S(1) | R | R | S(1) |

`heads` needs score and mask functions that do not read the head index (a rank sees its own heads
from 0) and masks shared by all heads, as the causal and document masks are. `batch` takes a mask
function's per-sequence tensors to be indexed by the batch index it is given, as the document mask's
is. The op then runs on each rank's local tensors, which autograd differentiates on them.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
from torch import fx
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import BlockMask

from .strategies import Spec, Strategy, evenly_sharded, tensor_args, tensor_outputs

FLEX_ATTENTION = torch.ops.higher_order.flex_attention


def _closure_tensors(fn: Any, found: dict[int, torch.Tensor], seen: set[int]) -> None:
    if id(fn) in seen:
        return
    seen.add(id(fn))
    if isinstance(fn, torch.Tensor):
        found.setdefault(id(fn), fn)
    elif isinstance(fn, (tuple, list)):
        for x in fn:
            _closure_tensors(x, found, seen)
    elif isinstance(fn, functools.partial):
        _closure_tensors((*fn.args, *fn.keywords.values(), fn.func), found, seen)
    elif callable(fn):
        for cell in getattr(fn, "__closure__", None) or ():
            _closure_tensors(cell.cell_contents, found, seen)


def mask_tensors(mask: BlockMask) -> list[torch.Tensor]:
    """The tensors a BlockMask is made of, in a fixed order: its block indices, then the tensors its
    mask function reads through its closure (and_masks keeps the combined functions in one)."""
    found: dict[int, torch.Tensor] = {}
    for t in mask.as_tuple():
        if isinstance(t, torch.Tensor):
            found.setdefault(id(t), t)
    _closure_tensors(mask.mask_mod, found, set())
    return list(found.values())


def is_batched(t: torch.Tensor, batch: int) -> bool:
    """A mask tensor indexed by sequence (laid out like the tokens) rather than shared by all of them."""
    return t.dim() > 0 and t.shape[0] == batch


def _reads_head_index(gm: fx.GraphModule, mod: fx.Node) -> bool:
    sub = getattr(gm, mod.target)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    return len(placeholders) > 1 and bool(placeholders[1].users)


def declared_strategies(node: fx.Node, sizes: tuple[int, ...]) -> list[Strategy]:
    """The op's strategies over the solver mesh: per dim `replicate`, `batch` or `heads` (see above)."""
    args = [a.meta["val"] for a in tensor_args(node)]
    q = args[0]
    batch, heads = q.shape[0], q.shape[1]
    score_mod, block_mask = node.args[3], node.args[4]
    in_mask = {id(a.meta["val"]) for a in block_mask if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)}
    n_out = len(tensor_outputs(node))
    rest = args[3:]
    choices: list[tuple[Spec, Spec]] = [(("R",) * 3 + ("R",) * len(rest), ("R",) * n_out)]
    choices.append((("S0",) * 3 + tuple("S0" if is_batched(t, batch) else "R" for t in rest), ("S0",) * n_out))
    gm = node.graph.owning_module
    if not any(_reads_head_index(gm, mod) for mod in (score_mod, block_mask[-1])):
        per_head = tuple("S1" if id(t) in in_mask and t.shape[1] == heads > 1 else "R" for t in rest)
        choices.append((("S1",) * 3 + per_head, ("S1",) * n_out))
    outs = [v for v in node.meta["val"] if isinstance(v, torch.Tensor)]
    found = []
    for combo in itertools.product(choices, repeat=len(sizes)):
        ins = tuple(tuple(c[0][j] for c in combo) for j in range(len(args)))
        out = tuple(tuple(c[1][j] for c in combo) for j in range(n_out))
        if all(evenly_sharded(s, v.shape, sizes) for s, v in zip(ins + out, args + outs)):
            found.append(Strategy(out, ins))
    return found


# Dynamo (jit) breaks its graph at this call and cannot rebuild the local views of the rotary
# embedding's complex tensors in the frame it resumes ("view_as_real is only supported for complex
# tensors"): it runs this as it is, as the SDPA one (apply.UnitRunner._local_attention).
@torch._dynamo.disable
def run_local(node: fx.Node, args: Any, mesh: Any) -> tuple:
    """The op on each rank's local shards of its inputs (laid out by one of the declared strategies);
    its outputs are laid out as the query is."""
    q = args[0]
    local = torch.utils._pytree.tree_map(lambda a: a.to_local() if isinstance(a, DTensor) else a, args)
    out = node.target(*local)
    # Global shapes and strides as traced, not derived from the shard: a rank's batch of one may carry
    # any stride on that size-one dimension, from which DTensor would infer a permuted global layout
    # (as for SDPA: apply.UnitRunner._local_attention).
    return tuple(DTensor.from_local(o, mesh, q.placements, run_check=False, shape=t.shape, stride=t.stride())
                 if isinstance(o, torch.Tensor) else o for o, t in zip(out, node.meta["val"]))
