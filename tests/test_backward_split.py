"""The zero-bubble split of a backward graph (capture/backward_split.py) on a two-layer block: the input part
computes the input's gradient without the weights' matmuls, and the two parts together give the unsplit
graph's gradients bit for bit."""

from __future__ import annotations

import torch
from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition

from graph_trainer.capture.backward_split import split_backward


def _block(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w1) @ w2


def _normed_block(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A norm between the matmuls: its backward is one op of several outputs, the input's gradient and the weight's."""
    return torch.nn.functional.layer_norm(x @ w1, (32,), weight=w2[:, 0].contiguous()) @ w2


def _backward_graph(block=_block) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """The partitioned backward graph of `block` and the inputs it is called with."""
    torch.manual_seed(0)
    w1, w2, x = (torch.randn(16, 32, requires_grad=True), torch.randn(32, 16, requires_grad=True),
                 torch.randn(8, 16, requires_grad=True))
    captured: list = []

    def keep_backward(gm, example_inputs):
        def run(args):
            captured.append((gm, list(args)))
            return gm(*args)

        return make_boxed_func(lambda *args: run(args))

    compiled = aot_function(block, fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=keep_backward,
                            partition_fn=min_cut_rematerialization_partition)
    compiled(w1, w2, x).sum().backward()
    gm, args = captured[0]
    return gm, args


def _mms(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)


def test_split_parts_give_the_unsplit_gradients_bitwise():
    gm, args = _backward_graph()
    whole = gm(*args)
    assert len(whole) == 3  # w1, w2, x
    split = split_backward(gm, [2])
    outs = split.input_part(*args)
    dx, crossing = outs[0], list(outs[1:])
    weights = split.weight_part(*[args[i] for i in split.weight_reads], *crossing)
    assert torch.equal(dx, whole[2])
    assert split.weight_positions == [0, 1]
    assert all(torch.equal(g, w) for g, w in zip(weights, whole[:2]))
    # dx needs the two activation-gradient matmuls; the weight gradients' two are left for W
    assert _mms(split.input_part) == 2 and _mms(split.weight_part) == 2 and _mms(gm) == 4


def test_an_op_of_several_outputs_hands_the_weight_part_tensors():
    """On GPUs (torch 2.11) the input part returned the fused norm backward's tuple itself, which the compile refused."""
    gm, args = _backward_graph(_normed_block)
    assert any(n.target is torch.ops.aten.native_layer_norm_backward.default for n in gm.graph.nodes)
    whole = gm(*args)
    split = split_backward(gm, [2])
    for part in (split.input_part, split.weight_part):
        assert all(isinstance(o.meta["val"], torch.Tensor) for o in part.graph.output_node().args[0])
    outs = split.input_part(*args)
    weights = split.weight_part(*[args[i] for i in split.weight_reads], *outs[1:])
    assert torch.equal(outs[0], whole[2]) and all(torch.equal(g, w) for g, w in zip(weights, whole[:2]))
