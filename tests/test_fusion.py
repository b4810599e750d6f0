"""The memory simulation under a whole-graph Inductor compile (`passes/fusion.py`): in a cross-entropy's
forward and backward over a [tokens, vocab] matmul, the fp32 cast, the log-softmax and its gradient are
fused into their readers (never written), while the logits (a matmul's output), the NLL's gradient (a
scatter) and the bf16 gradient the backward matmul reads are written; the simulated peak is the hand
count of what is written, and the same values left unfused are counted as the unfused graph holds them.
A value read in another piece (a block's forward value its backward reads) is written."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.passes.fusion import unmaterialized
from graph_trainer.passes.liveness import Simulator, graph_schedule

TOKENS, DIM, VOCAB = 64, 16, 1000
F32, BF16 = TOKENS * VOCAB * 4, TOKENS * VOCAB * 2


def _loss_step(hidden, weight, labels, grad):
    logits = hidden @ weight.t()
    loss = F.cross_entropy(logits.float(), labels)
    dlogits = torch.autograd.grad(loss, logits, grad)[0]
    return loss, dlogits @ weight


def _traced():
    args = (torch.randn(TOKENS, DIM, dtype=torch.bfloat16, requires_grad=True), torch.randn(VOCAB, DIM, dtype=torch.bfloat16),
            torch.randint(0, VOCAB, (TOKENS,)), torch.ones((), dtype=torch.float32))
    return make_fx(_loss_step)(*args)


def _by_target(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__.startswith(name)]


def test_cross_entropy_fuses_the_fp32_tensors_it_can():
    gm = _traced()
    fused = unmaterialized(gm.graph.nodes, lambda n: None)
    lsm, = _by_target(gm, "_log_softmax.")
    lsm_grad, = _by_target(gm, "_log_softmax_backward_data")
    nll_grad, = _by_target(gm, "nll_loss_backward")
    casts = _by_target(gm, "_to_copy")
    up = [c for c in casts if c.meta["val"].dtype == torch.float32]
    down = [c for c in casts if c.meta["val"].dtype == torch.bfloat16]
    assert len(up) == 1 and len(down) == 1
    assert {lsm, lsm_grad, up[0]} <= fused
    assert not fused & {nll_grad, down[0], *_by_target(gm, "mm")}

    fused_peak = Simulator(fused)(graph_schedule(gm.graph.nodes)).peak
    plain_peak = Simulator()(graph_schedule(gm.graph.nodes)).peak
    # written: the bf16 logits, read by the fused cast and log-softmax; the fp32 NLL gradient (a scatter);
    # the bf16 logits' gradient, made by the fused log-softmax backward from the logits and the NLL gradient
    # and the loss, one fp32 scalar
    assert fused_peak == 2 * BF16 + F32 + 4
    # unfused, the log-softmax, the NLL gradient and the log-softmax gradient (fp32) are live together
    assert plain_peak == 3 * F32 + 4


def test_a_value_read_in_another_piece_is_written():
    gm = _traced()
    lsm, = _by_target(gm, "_log_softmax.")
    # the log-softmax's backward in another piece (a block's backward read of its forward's value)
    other = unmaterialized(gm.graph.nodes, lambda n: "backward" if n.name.startswith(("_log_softmax_backward", "nll_loss_backward")) else "forward")
    assert lsm not in other
