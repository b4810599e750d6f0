"""--training.loss fused_linear_ce: output projection + cross-entropy chunked over tokens.

Bound. Every token's logits, log-softmax and NLL are computed row by row as in the unfused loss; what
differs is the order of two fp32 sums over tokens: the loss (sum of N NLLs, chunk by chunk) and the
output weight's gradient (one GEMM over N tokens vs a sum of chunk GEMMs). Recursive summation of N
terms errs by at most (N - 1) u times the sum of their magnitudes (u = 2^-24), which is the bound
asserted on one step. Over 10 training steps the parameters differ by those roundings, which AdamW's
normalised update carries on: there the bound is 1e-4 relative (measured: under 1e-6).
"""

from __future__ import annotations

import re

import pytest
import torch

from helpers import cached_run, losses, read_metrics

from graph_trainer.config import ConfigError, parse_args
from graph_trainer.losses import IGNORE_INDEX, cross_entropy, fused_linear_cross_entropy
from graph_trainer.validate import validate

U = 2.0**-24
SMALL = ("--training.batch_size", "8", "--training.seq_len", "64", "--model.n_layers", "2", "--training.steps", "10",
         "--compile.mode", "aot_fx_trace", "--compile.dump_graphs")
TOKENS, VOCAB, DIM, CHUNK = 8 * 64, 2048, 256, 48
FUSED = ("--training.loss", "fused_linear_ce", "--training.loss_chunk_tokens", str(CHUNK))


def test_one_step_within_the_summation_bound_of_unfused():
    torch.manual_seed(0)
    n, dim, vocab = 300, 64, 1000
    hidden = torch.randn(n, dim, requires_grad=True)
    weight = (torch.randn(vocab, dim) * 0.1).requires_grad_()
    labels = torch.randint(0, vocab, (n,))
    labels[::7] = IGNORE_INDEX
    logits = hidden @ weight.t()
    logits.retain_grad()
    ref = cross_entropy(logits.unsqueeze(0), labels.unsqueeze(0))
    ref.backward()
    ref_gh, ref_gw, dlogits = hidden.grad.clone(), weight.grad.clone(), logits.grad
    hidden.grad = weight.grad = None
    fused = fused_linear_cross_entropy(hidden, weight, labels, CHUNK)
    fused.backward()
    counted = int((labels != IGNORE_INDEX).sum())
    assert abs(fused.item() - ref.item()) <= (counted - 1) * U * ref.item()
    # grad wrt hidden: row by row the same ops; grad wrt weight: a sum over n tokens in another order.
    assert (hidden.grad - ref_gh).abs().max().item() <= n * U * (dlogits.abs() @ weight.detach().abs()).max().item()
    assert ((weight.grad - ref_gw).abs() <= (n - 1) * U * (dlogits.abs().t() @ hidden.detach().abs())).all()


@pytest.mark.slow
def test_ten_steps_within_bound_of_unfused():
    unfused, fused = read_metrics(cached_run(SMALL)), read_metrics(cached_run(SMALL + FUSED))
    a, b = losses(unfused), losses(fused)
    assert abs(a[0] - b[0]) <= (TOKENS - 1) * U * a[0]
    assert all(abs(x - y) <= 1e-4 * x for x, y in zip(a, b))
    assert a[-1] < a[0] - 0.5  # the runs trained: equal losses are not equal constants


@pytest.mark.slow
def test_full_inductor_adds_every_chunks_weight_gradient():
    """Under the whole-step Inductor compile each chunk's weight gradient is summed by `add_product_`, an op Inductor
    does not fuse (its fused additions held every chunk's [vocab, dim] product at once on GPUs): the same bound to the
    unfused loss as without Inductor. An op that added nothing left the output projection untrained: 2.7% off."""
    unfused = read_metrics(cached_run(SMALL))
    compiled = read_metrics(cached_run(SMALL + FUSED + ("--compile.inductor_compilation", "full")))
    assert all(abs(x - y) <= 1e-4 * x for x, y in zip(losses(unfused), losses(compiled)))


def _largest_node_elements(graph_file) -> tuple[int, list[tuple[int, ...]]]:
    """The largest tensor a node of the dumped traced graph produces (elements), and every shape."""
    shapes = [tuple(int(d) for d in dims.split(", ")) for dims in re.findall(r': "f32\[(\d+(?:, \d+)*)\]', graph_file.read_text())]
    return max(torch.Size(s).numel() for s in shapes), shapes


@pytest.mark.slow
def test_no_node_holds_the_whole_logits():
    unfused_max, unfused_shapes = _largest_node_elements(cached_run(SMALL) / "graphs" / "00_traced.py")
    fused_max, fused_shapes = _largest_node_elements(cached_run(SMALL + FUSED) / "graphs" / "00_traced.py")
    assert (TOKENS, VOCAB) in unfused_shapes and unfused_max == TOKENS * VOCAB
    assert not any(VOCAB in s and torch.Size(s).numel() >= TOKENS * VOCAB for s in fused_shapes)
    assert (CHUNK, VOCAB) in fused_shapes and (TOKENS % CHUNK, VOCAB) in fused_shapes
    # The largest tensors left are the output weight and its fp32 gradient, half the logits here.
    assert fused_max == VOCAB * DIM < TOKENS * VOCAB


@pytest.mark.slow
def test_fsdp_gathers_the_output_weight_and_stays_within_bound():
    mesh = ("--parallelism.dp_shard", "2")
    unfused, fused = read_metrics(cached_run(SMALL + mesh, 2)), read_metrics(cached_run(SMALL + mesh + FUSED, 2))
    assert all(abs(x - y) <= 1e-4 * x for x, y in zip(losses(unfused), losses(fused)))


@pytest.mark.parametrize("flags, needle", [
    (("--parallelism.dp_shard", "1", "--parallelism.tp", "2"), "--training.loss fused_linear_ce needs --parallelism.tp 1"),
    (("--compile.autoparallel",), "needs --compile.autoparallel false"),
    (("--training.loss_chunk_tokens", "0"), "training.loss_chunk_tokens must be >= 1"),
], ids=["tp", "autoparallel", "chunk"])
def test_declared_constraints_are_refused_with_one_line(flags, needle):
    world = 2 if "--parallelism.tp" in flags else 1
    with pytest.raises(ConfigError) as err:
        validate(parse_args(["--training.loss", "fused_linear_ce", *flags]), world_size=world, device_type="cpu")
    assert needle in str(err.value) and "\n" not in str(err.value)
