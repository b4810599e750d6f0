"""The training losses `--training.loss` chooses: plain cross-entropy on the model's logits, or the
output projection fused with cross-entropy and chunked over tokens.

At a 128k vocabulary the [tokens, vocab] logits are the largest activation of a step (llama3 1B,
4 x 4096 tokens: 8.4 GiB in fp32). `fused_linear_ce` makes the model's output layer return the final
hidden state and its (gathered) weight instead of logits; the loss then computes logits, log-softmax,
NLL and both gradients one chunk of `loss_chunk_tokens` tokens at a time, so at most one chunk's
logits exist. The gradients are computed in the forward pass, while the chunk's logits are at hand
(no second projection in backward), and backward only scales them by the incoming gradient.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import register_flop_formula

from .train_step import LossFn

IGNORE_INDEX = -100
"""Label of a token that does not count, as in `torch.nn.functional.cross_entropy`."""


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX)


# Each chunk's work ends before the next chunk's starts, so that its [chunk, vocab] and [vocab, dim] values die with
# it: the next chunk's hidden states are read through `copy_after` the weight gradient's sum, and that sum is one op
# Inductor does not see into (`add_product_`). Written as `acc += (a @ b).float()`, Inductor fused every chunk's
# addition into one kernel after the last chunk's GEMM, holding the four chunks' [vocab, dim] products (4 x 0.98 GiB at
# llama3 8B, 8192 tokens a rank); with the sum in one op it still ran every chunk's log-softmax before the first
# chunk's gradients, holding their fp32 [chunk, vocab] values (3 x 0.98 GiB; allocator snapshots and Inductor's code
# in bench/results/2026-11-30-session26, calls 2-5).


@torch.library.custom_op("graph_trainer::add_product_", mutates_args=("acc",))
def add_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, the product summed into acc's dtype inside the GEMM (bf16 operands into an fp32 acc: never
    rounded to bf16)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_((a @ b).to(acc.dtype))


@add_product_.register_fake
def _(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    return None


@torch.library.custom_op("graph_trainer::copy_after", mutates_args=())
def copy_after(x: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """A copy of x, taken once `after` holds its value (an op Inductor cannot move before the op that writes it)."""
    return x.clone()


@copy_after.register_fake
def _(x: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@register_flop_formula(torch.ops.graph_trainer.add_product_)
def _(acc_shape: torch.Size, a_shape: torch.Size, b_shape: torch.Size, *args, **kwargs) -> int:
    """A GEMM's: the cost model prices the chunks' weight gradients (8.6 TFLOP a step at llama3 8B) by it."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean over counted tokens of -log softmax(hidden @ weight.T)[label], chunked over tokens."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        counted = labels != IGNORE_INDEX
        # The mean divides by the counted tokens of the whole batch: every chunk's share is divided by it.
        count = counted.sum().clamp(min=1).float()
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        # Chunks' weight gradients add up in fp32: in bf16 every addition would round.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], chunk):
            h = copy_after(hidden[start : start + chunk], grad_weight)
            target = labels[start : start + chunk].clamp(min=0).unsqueeze(1)
            keep = counted[start : start + chunk].unsqueeze(1)
            logp = torch.log_softmax((h @ weight.t()).float(), dim=-1)
            loss = loss - (logp.gather(1, target) * keep).sum()
            # d loss / d logits = (softmax - one_hot(label)) / counted tokens, zero on ignored tokens.
            dlogits = logp.exp_().scatter_add_(1, target, torch.full_like(target, -1.0, dtype=logp.dtype))
            dlogits = (dlogits * keep / count).to(hidden.dtype)
            grad_hidden[start : start + chunk] = dlogits @ weight
            add_product_(grad_weight, dlogits.t(), h)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss.to(grad_weight.dtype), None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, labels) without the whole logits: hidden [tokens, dim],
    weight [vocab, dim], labels [tokens]; `chunk` tokens' logits at a time."""
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk)


class FusedLinearCrossEntropy:
    """The loss of a model whose output layer returns (final hidden state, output weight)."""

    def __init__(self, chunk_tokens: int):
        self.chunk_tokens = chunk_tokens

    def __call__(self, output: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        hidden, weight = output
        return fused_linear_cross_entropy(hidden.flatten(0, 1), weight, labels.flatten(0, 1), self.chunk_tokens)


_HIDDEN_OUTPUT_CLASSES: dict[type, type] = {}


def _hidden_output_forward(self: nn.Linear, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Reading `self.weight` is what gathers it under SimpleFSDP (and reduce-scatters its gradient).
    return hidden, self.weight


def _hidden_output_class(cls: type) -> type:
    if cls not in _HIDDEN_OUTPUT_CLASSES:
        _HIDDEN_OUTPUT_CLASSES[cls] = type(f"HiddenOutput{cls.__name__}", (cls,), {"forward": _hidden_output_forward})
    return _HIDDEN_OUTPUT_CLASSES[cls]


def build_loss(name: str, model: nn.Module, chunk_tokens: int) -> LossFn:
    """The loss function for `--training.loss`. For fused_linear_ce the model's `output` layer (after
    placement, so its parameter names and sharding stay) is switched to return its input and weight."""
    if name == "cross_entropy":
        return cross_entropy
    output = model.output
    assert isinstance(output, nn.Linear) and output.bias is None, "fused_linear_ce needs a bias-free nn.Linear output layer"
    output.__class__ = _hidden_output_class(type(output))
    return FusedLinearCrossEntropy(chunk_tokens)
