"""recompute_pointwise: an activation a pointwise op makes inside a transformer block from values
backward keeps anyway is recomputed in backward instead of saved.

A make_fx-traced train step saves what autograd saved: SwiGLU's `silu(x1)` and `silu(x1) * x3` beside
the two matmul outputs they come from, casts beside the values they cast. A compiler that partitions
forward from backward (AOTAutograd's min-cut partitioner, which torchtitan's per-block compile gets)
recomputes such ops in backward, where Inductor fuses them into the backward kernels that read their
inputs anyway; one train-step graph cut into pieces cannot, since every value crossing from a
forward piece to a backward piece is materialized. On llama3 8B (selective AC every 2nd block) that
is two [tokens, 14336] bf16 tensors per uncheckpointed block: 7 GiB of 8192 tokens at 32 layers.

For each saved value made by a pointwise op, a cast on the same device or a view (`fusion.cheap`), in
graph order: its chain back through such ops to saved values (or values outside the block: the
residual stream stays saved) is recomputed where that lowers the saved bytes (`recompute.Ledger`: a
chain whose inputs would have to be saved in its place frees nothing) and adds no parameter gather.
The rewrite is the memory policy's (`recompute_in_backward`): the same ops on the same inputs, so the
step's results are bitwise those without the pass where the ops run one by one. Runs before
`memory_policy`, which then chooses among what is still saved.
"""

from __future__ import annotations

import logging

from torch import fx

from ..units import GiB
from .activations import Activations
from .fusion import cheap
from .recompute import Ledger, recompute_in_backward, recomputed_bytes
from .registry import PassContext, PassSpec, register_pass

logger = logging.getLogger("graph_trainer")


def recompute_pointwise(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    acts = Activations.of_step(gm, ctx)
    ledger = Ledger(acts)
    before = ledger.bytes
    block_of = acts.block_of

    def outside(block):
        return lambda n: block_of.get(n) != block or not cheap(n)

    for node in acts.order:
        block = block_of.get(node)
        if block is None or not cheap(node) or not ledger.saved(node):
            continue
        chain = ledger.closure([node], outside(block))
        if chain and not acts.new_gathers(chain) and ledger.delta(chain) < 0:
            ledger.apply(chain)
    if ledger.rc:
        recompute_in_backward(gm, acts, ledger.rc)
    ctx.report.setdefault("recompute_pointwise", {}).update(
        pointwise_recomputed=len(ledger.rc), pointwise_saved_gib=(before - ledger.bytes) / GiB)
    logger.info(f"recompute_pointwise: {len(ledger.rc)} values recomputed in backward, saved activations "
                f"{before / GiB:.3f} -> {ledger.bytes / GiB:.3f} GiB ({recomputed_bytes(acts, ledger.rc) / GiB:.3f} GiB written again)")
    return gm


register_pass(PassSpec(
    name="recompute_pointwise",
    description="recompute in backward the activations pointwise ops make inside a block from saved values "
                "(--activation_checkpoint.recompute_pointwise)",
    stages=("train_step",),
    modes=("aot_fx_trace",),
    fn=recompute_pointwise,
    set_by="--activation_checkpoint.recompute_pointwise",
))
