"""What a traced step computes and never reads, taken out of the graph.

make_fx records a checkpointed block's recomputation whole, the block's output included, which backward never
reads (torch's checkpoint stops recomputing early when it runs eagerly; a trace runs it to the end). FX's
dead-code elimination removes such ops, except where a functional collective is on the way: its wait is marked
side-effecting, so the collective, and every op it reads, stay. With tensor parallelism each checkpointed block
recomputed its last row-parallel matmul and reduce-scatter for nothing (llama3 8B-16L at tp 2: 8 matmuls more
than torchtitan's step, bench/results/2026-11-30-session22). A collective whose result nothing reads is dropped
with its wait; whether anything reads it is a matter of the graph's ops, which are the same on every rank, so every
rank drops the same collectives.
"""

from __future__ import annotations

from torch import fx

from ..passes.bucketing_compat import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, WAIT

OUT_OF_PLACE = frozenset({ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL})
"""Collectives that only make their result (an in-place one writes into its input, which others read)."""


def drop_unread(gm: fx.GraphModule) -> int:
    """Remove the ops whose results nothing reads, functional collectives included; how many collectives went."""
    graph = gm.graph
    dropped = 0
    while True:
        graph.eliminate_dead_code()
        unread = [w for w in graph.find_nodes(op="call_function", target=WAIT)
                  if not w.users and w.args[0].target in OUT_OF_PLACE and len(w.args[0].users) == 1]
        if not unread:
            break
        for wait in unread:
            collective = wait.args[0]
            graph.erase_node(wait)
            graph.erase_node(collective)
        dropped += len(unread)
    gm.recompile()
    return dropped
