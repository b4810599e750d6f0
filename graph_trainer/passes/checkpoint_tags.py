"""checkpoint_tags: the forward ops of each activation-checkpointed transformer block tagged for the
min-cut partitioner to recompute, on the joint graphs of `aot` and of pipeline stages.

torchtitan's wrappers (`--activation_checkpoint.mode full`, and `selective` with a layer frequency)
checkpoint a block through torch.utils.checkpoint's saved-tensor hooks. A train step traced whole by
make_fx runs those hooks in backward and so records the recomputation; AOTAutograd's joint export
does not: the joint graph of a wrapped block was the one without the wrapper, with no tag, and the
partitioner saved what eager recomputes (llama3 8B-16L pp 2, 1F1B, on 2 H200s: 9 GiB more peak active
memory than torchtitan with the same AC, and none of its recomputation). Under torch.compile, Dynamo
turns the wrapper into a higher-order op that tags the region's ops; this pass sets the same tags
from the block marks (`blocks.CHECKPOINTED_KEY`, set on the wrapped blocks):
`recompute = PREFER_RECOMPUTE` and one `ac_graph_id` per block on every forward op of the block that
is computed from activations, except the block's outputs to the rest of the forward (the residual
stream the next op outside the block reads, which eager saves as that op's input). Ops computed from
parameters alone (a gathered weight, its cast) are `reshard_after_forward`'s; an op already tagged
keeps its tag. Ops that draw random numbers (attention) are saved, never recomputed (`_seeded`): a
checkpointed block keeps its attention's outputs, as op-level selective AC does.

Op-level selective AC's wrappers do tag their ops while AOTAutograd traces, each with the policy's
save or recompute, but with no region id outside Dynamo, which the partitioner compares (torch 2.13:
"'>' not supported between instances of 'NoneType'"): they get their block's. Their tag also stays
in the tracer's current node meta past the region, on backward ops and on the forward ops after the
blocks (the final norm, the output projection, the loss), which would be recomputed: those tags (no
region id, outside a block's forward) are dropped.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ..blocks import CHECKPOINTED_KEY, node_block
from .registry import PassContext, PassSpec, register_pass

FLAG = "--activation_checkpoint.mode"


def _checkpointed(node: fx.Node) -> bool:
    return bool((node.meta.get("custom") or {}).get(CHECKPOINTED_KEY))


def _seeded(node: fx.Node) -> bool:
    """An op that draws random numbers (attention, for its dropout): recomputing it takes the partitioner's RNG
    functionalization, whose `run_and_save_rng_state` the Inductor decomposition cannot trace ("no rule registered
    for HigherOrderOperator run_and_save_rng_state and mode FunctionalTensorMode", CPU; on 2 H200s the stage
    compile did not end within 150 s)."""
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" in str(node.target)


def checkpoint_tags(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    held = set(gm.graph.find_nodes(op="placeholder")[: ctx.num_params + ctx.num_buffers])
    backward: set[fx.Node] = set()
    from_params: set[fx.Node] = set(held)
    for node in gm.graph.nodes:
        if _is_tangent(node) or any(a in backward for a in node.all_input_nodes):
            backward.add(node)
        elif node.op == "call_function" and node.all_input_nodes and all(a in from_params for a in node.all_input_nodes):
            from_params.add(node)

    def in_block(user: fx.Node, block: int) -> bool:
        """Whether `user` reads the value only where recomputing it is the block's own business: in backward, or
        in the block's forward (the joint graph's output node holds the forward's outputs too)."""
        return user.op != "output" and (user in backward or node_block(user) == block and _checkpointed(user))

    tagged: set[int] = set()
    for node in gm.graph.nodes:
        block = node_block(node)
        if node not in backward and (_seeded(node) or node.target is operator.getitem and _seeded(node.args[0])):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            continue
        if "recompute" in node.meta:
            if node.meta.get("ac_graph_id") is None:
                if block is None or node in backward:
                    del node.meta["recompute"]
                else:
                    node.meta["ac_graph_id"] = block + 1
                    tagged.add(block)
            continue
        if node.op != "call_function" or node in backward or node in from_params or block is None or not _checkpointed(node):
            continue
        if all(in_block(user, block) for user in node.users):
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            node.meta["ac_graph_id"] = block + 1
            tagged.add(block)
    ctx.report.setdefault("checkpoint_tags", {})["checkpointed_blocks"] = len(tagged)
    return gm


register_pass(PassSpec(
    name="checkpoint_tags",
    description="tag the forward ops of activation-checkpointed blocks for the partitioner to recompute "
                "(set by --activation_checkpoint.mode full or selective, in aot and pipeline stages)",
    stages=("joint",),
    modes=("aot", "aot_fx_trace"),
    fn=checkpoint_tags,
    set_by=FLAG,
))
