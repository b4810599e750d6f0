"""Auto placement keeps from forward to backward what manual SimpleFSDP keeps: activation
checkpointing recomputes the same blocks, and every gathered parameter is freed after forward and
gathered again for backward (`reshard_after_forward`), on llama3 debug's traced step (2 fake ranks);
and it reduces every gradient in `--training.mixed_precision_reduce`, also where the plan redistributes
a view of the parameter (its transpose) rather than the parameter."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from graph_trainer.capture.fake_trace import trace_on_fake_mesh
from graph_trainer.config import parse_args
from graph_trainer.graph_dump import nbytes
from graph_trainer.losses import cross_entropy
from graph_trainer.passes.bucketing_compat import REDUCE_SCATTER
from graph_trainer.passes.collectives import find_collectives
from graph_trainer.passes.memory_policy import Activations
from graph_trainer.passes.registry import PassContext, apply_passes
from graph_trainer.train_step import FunctionalTrainStep

from helpers import grad_norms, losses, run_train

SELECTIVE = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2")
aten = torch.ops.aten


def _kept(*flags: str) -> dict:
    """What the traced step (after reshard_after_forward) keeps across the loss: bytes of floating-point
    activations (values computed from the batch) and of values derived from the weight matrices
    (shards kept to gather again, gathered weights), how many matmuls it runs (recomputation repeats
    a block's forward matmuls in backward), and how many reduce-scatters it has and how many of them
    the scheduling passes take for gradient reduce-scatters. Left out, as the two plans differ there by
    design: token ids (the solver runs the embedding on its table's hidden-dim shard for every rank's
    tokens and keeps the gathered ids) and the norms' 1-D weights (the solver keeps them replicated:
    gathering them costs more latency than their bytes are worth)."""
    cfg = parse_args(["--compile.mode", "aot_fx_trace", "--parallelism.dp_shard", "2", "--training.batch_size", "4",
                      "--training.seq_len", "256", *flags])
    try:
        r = trace_on_fake_mesh(cfg, 2)
        specs = FunctionalTrainStep(r.model, cross_entropy).specs
        gm = r.graph
        inputs = gm.graph.find_nodes(op="placeholder")
        n_buffers = len(inputs) - len(specs) - 2
        ctx = PassContext(cfg=cfg, meshes=r.meshes, device=torch.device("cpu"), num_params=len(specs),
                          num_buffers=n_buffers, param_fqns=[s.fqn for s in specs])
        scatters = {"traced": len(gm.graph.find_nodes(op="call_function", target=REDUCE_SCATTER)),
                    "found": sum(c.kind == "reduce_scatter" for c in find_collectives(gm))}
        gm = apply_passes(gm, ["reshard_after_forward"], ctx, "train_step")
    finally:
        dist.destroy_process_group()
    acts = Activations(gm, set(gm.graph.find_nodes(op="placeholder")[len(specs) + n_buffers:][:2]))
    kept: dict[str, dict] = {"activations": {}, "params": {}}
    for node in acts.order[: acts.pos_of_loss + 1]:
        if node.op == "call_function" and any(acts.is_backward(u) for u in node.users):
            root = acts.roots[node]
            val = root.meta.get("val")
            if isinstance(val, torch.Tensor) and not val.is_floating_point():
                continue
            if node in acts.forward:
                kept["activations"][root] = nbytes(val)
            elif val.dim() >= 2:
                kept["params"][root] = nbytes(val)
    return {"activations": sum(kept["activations"].values()), "params": sum(kept["params"].values()),
            "matmuls": sum(1 for n in gm.graph.nodes if n.target is aten.mm.default), "scatters": scatters}


def test_auto_placed_step_keeps_and_recomputes_what_the_manual_one_does():
    manual, auto = _kept(*SELECTIVE), _kept(*SELECTIVE, "--compile.autoparallel")
    unchecked = _kept("--compile.autoparallel")
    # every 2nd of the 6 blocks recomputes 6 of its 7 matmuls in backward: not w2's, whose output only makes the
    # block's output, which backward does not read (the trace drops it: capture/unread.py)
    assert auto["matmuls"] == manual["matmuls"] == unchecked["matmuls"] + 3 * 6
    assert auto["activations"] == manual["activations"] < unchecked["activations"]
    # The solver gathered some weights along their dim 1 (its model priced that like dim 0); DTensor
    # then concatenates the gathered chunks, and reshard_after_forward cannot follow a gather through
    # that cat: those gathered weights stayed alive into backward (13.5% more bytes kept here).
    assert auto["params"] == manual["params"]
    # A weight stored as its transpose's dim-0 shard gets its gradient through a copy into a buffer of
    # the parameter's strides: still a gradient reduce-scatter, which the schedulers bucket and overlap.
    assert auto["scatters"]["found"] == auto["scatters"]["traced"] > 0
    assert manual["scatters"]["found"] == manual["scatters"]["traced"] > 0


@pytest.mark.slow
def test_auto_placed_selective_ac_trains_bitwise_like_no_ac(tmp_path):
    common = ["--model.n_layers", "2", "--training.steps", "3", "--training.batch_size", "4", "--training.seq_len", "128",
              "--compile.mode", "aot_fx_trace", "--parallelism.dp_shard", "2", "--compile.autoparallel"]
    plain = run_train(common, tmp_path / "plain", nproc=2)
    checked = run_train([*common, *SELECTIVE[:2], "--activation_checkpoint.selective_ac_option", "1"], tmp_path / "ac", nproc=2)
    assert losses(checked) == losses(plain) and grad_norms(checked) == grad_norms(plain)


def _bytes_autograd_keeps(flags: list[str]) -> tuple[float, float]:
    """(what the plan on one rank counts as activations saved for backward, the bytes autograd keeps
    when the model's forward runs eagerly on fake tensors with bf16 parameters requiring grad: saved
    tensors deduplicated by storage, parameters, buffers and token ids left out as the plan does)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.multiprocessing.reductions import StorageWeakRef

    from graph_trainer import models
    from graph_trainer.autoparallel.moe import prepare_model
    from graph_trainer.plan import make_plan

    cfg = parse_args([*flags, "--parallelism.dp_shard", "1", "--activation_checkpoint.mode", "none"])
    estimate = make_plan(cfg)["predicted"]["memory_bytes"]["activations"]
    spec = models.get_spec(cfg.model.name)
    model = models.build_on_meta(spec, spec.job_args(cfg), "cpu")
    prepare_model(model)
    saved: dict[StorageWeakRef, float] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with FakeTensorMode(allow_non_fake_inputs=True):
        params = {n: torch.empty(p.shape, dtype=torch.bfloat16, requires_grad=True) for n, p in model.named_parameters()}
        buffers = {n: torch.empty_strided(b.shape, b.stride(), dtype=b.dtype) for n, b in model.named_buffers()}
        tokens = torch.zeros(cfg.training.batch_size, cfg.training.seq_len, dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            functional_call(model, params | buffers, (tokens,))
    for t in [*params.values(), *buffers.values(), tokens]:
        saved.pop(StorageWeakRef(t.untyped_storage()), None)
    return estimate, sum(saved.values())


def test_auto_placed_gradients_reduce_in_the_reduce_dtype():
    """bf16 parameters, fp32 reductions: each gradient reduce-scatter of the traced step is fp32. The debug
    model's plan on 2 ranks redistributes the weights' transposes, whose gradients were reduce-scattered in
    bf16 (43 of 43) before `apply.UnitRunner` gave those views the parameter's reduce dtype."""
    cfg = parse_args(["--compile.mode", "aot_fx_trace", "--compile.autoparallel", "--parallelism.dp_shard", "2",
                      "--training.batch_size", "4", "--training.seq_len", "256", "--training.mixed_precision_param", "bfloat16"])
    try:
        graph = trace_on_fake_mesh(cfg, 2).graph
        reductions = [c for c in find_collectives(graph) if c.kind == "reduce_scatter"]
    finally:
        dist.destroy_process_group()
    assert len(reductions) > 30
    assert {c.start.meta["val"].dtype for c in reductions} == {torch.float32}


def test_plan_counts_the_activations_autograd_keeps():
    # exact: the plan charges each saved storage once at its producing op (memory.autograd_keeps);
    # the eager forward here saves through torchtitan's modules, not the traced unit graphs. (DeepSeek
    # differs by design on a CPU: its MLA attention runs the math kernel, which keeps the scores the
    # plan does not charge, and the routed experts' buffers are a row of their own.)
    estimate, kept = _bytes_autograd_keeps(["--config", "configs/llama3_debug.toml", "--training.batch_size", "2",
                                            "--training.seq_len", "256"])
    assert estimate == kept
