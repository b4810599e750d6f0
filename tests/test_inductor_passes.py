"""The Inductor passes: region marks reach the backward, decomposition keeps them and leaves no
decomposable op, regional and full Inductor compute what the FX graph computes (on a toy train step,
in this process), and llama3 debugmodel trains with them (aot_fx_trace, 1 rank and dp_shard=2) with
losses within 1e-4 relative of eager, every stage in the graph dumps."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import fx, nn
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers import cached_run, losses, read_metrics
from test_bucketing import fake_pg  # noqa: F401  (fixture)

from graph_trainer.graph_dump import GraphDumper
from graph_trainer.passes.compat import select_decomp_table
from graph_trainer.passes.inductor import full_inductor_compilation, inductor_decomposition, regional_inductor_pass
from graph_trainer.passes.registry import Compiled, PassContext, apply_passes
from graph_trainer.regions import REGION_KEY, BackwardSeqNr, ancestors, annotate_regions, copy_marks_to_backward, region_tag

DIM = 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.Linear(DIM, DIM, bias=False)
        self.feed_forward = nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=False), nn.SiLU(), nn.Linear(2 * DIM, DIM, bias=False))

    def forward(self, x):
        h = x + torch.tanh(self.attention(x))
        return h + self.feed_forward(nn.functional.rms_norm(h, (DIM,)))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(2)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def toy_train_step(model: nn.Module):
    """(params..., x, y) -> (loss, *grads), traced like capture/fx_trace.py traces the real step."""
    names = [n for n, _ in model.named_parameters()]

    def step(*args):
        params, (x, y) = args[:-2], args[-2:]
        out = torch.func.functional_call(model, dict(zip(names, params)), (x,))
        loss = nn.functional.mse_loss(out, y)
        return (loss.detach(), *torch.autograd.grad(loss, params))

    torch.manual_seed(0)
    real = [p.detach().clone().requires_grad_(True) for p in model.parameters()] + [torch.randn(4, DIM), torch.randn(4, DIM)]
    mode = FakeTensorMode()
    fake = [mode.from_tensor(t).requires_grad_(t.requires_grad) for t in real]
    with mode, fx_traceback.preserve_node_meta(), BackwardSeqNr():
        gm = make_fx(step, tracing_mode="real")(*fake)
    copy_marks_to_backward(gm)
    ctx = PassContext(cfg=None, meshes=None, device=torch.device("cpu"), example_inputs=real, num_params=len(names))
    return gm, ctx, real


def marked(gm) -> list:
    return [n for n in gm.graph.nodes if REGION_KEY in (n.meta.get("custom") or {})]


@pytest.fixture
def toy():
    torch.manual_seed(0)
    model = annotate_regions(Toy(), ("feed_forward",))
    return toy_train_step(model)


def test_marks_reach_the_backward_of_the_region_only(toy):
    gm, _, _ = toy
    mms = [n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default]
    # forward: 2 attention + 4 feed-forward matmuls; backward: 2 per forward matmul but the first
    # layer's attention input grad is not needed (inputs do not require grad): 2*6-1
    assert len(mms) == 6 + 11
    marked_mms = [n for n in mms if n in set(marked(gm))]
    assert len(marked_mms) == 4 + 8
    tags = {n.meta["custom"][REGION_KEY]["region"] for n in marked(gm)}
    assert tags == {"feed_forward"}
    tanh_backward = [n for n in gm.graph.nodes if n.target == torch.ops.aten.tanh_backward.default]
    assert tanh_backward and not set(tanh_backward) & set(marked(gm))


def test_unmarked_model_has_no_marks():
    torch.manual_seed(0)
    gm, _, _ = toy_train_step(Toy())
    assert marked(gm) == []


def test_decomposition_keeps_marks_and_leaves_no_decomposable_op(toy):
    gm, ctx, real = toy
    out = inductor_decomposition(gm, ctx)
    table = select_decomp_table()
    aten = torch.ops.aten
    # Inductor decomposes these always (others in its table, e.g. mm, only for some shapes)
    always = {aten.silu.default, aten.silu_backward.default, aten.tanh_backward.default, aten.mse_loss.default,
              aten.mse_loss_backward.default, aten.t.default, aten.ones_like.default}
    assert always <= set(table)
    before = {n.target for n in gm.graph.nodes}
    after = {n.target for n in out.graph.nodes}
    assert always <= before and not always & after
    assert any(n.target == torch.ops.aten.mm.default for n in marked(out))
    with torch.no_grad():
        for a, b in zip(gm(*real), out(*real)):
            torch.testing.assert_close(a, b)


def test_regional_inductor_compiles_the_regions_only(toy):
    gm, ctx, real = toy
    with torch.no_grad():
        expected = gm(*real)
    compiled = regional_inductor_pass(gm, ctx)
    assert isinstance(compiled, Compiled)
    code = compiled.graph_module.code
    assert code.count("standalone_compile") >= 2
    left = {n.target for n in compiled.graph_module.graph.nodes}
    assert torch.ops.aten.tanh.default in left and torch.ops.aten.silu.default not in left
    for a, b in zip(expected, compiled(*real)):
        torch.testing.assert_close(a, b)


def test_regional_inductor_without_marks_says_how_to_mark():
    torch.manual_seed(0)
    gm, ctx, _ = toy_train_step(Toy())
    with pytest.raises(RuntimeError, match="annotate_regions"):
        regional_inductor_pass(gm, ctx)


def test_full_inductor_through_apply_passes_dumps_every_stage(toy, tmp_path):
    gm, ctx, real = toy
    with torch.no_grad():
        expected = gm(*real)
    ctx.dumper = GraphDumper(tmp_path)
    compiled = apply_passes(gm, ["inductor_decomposition", "full_inductor_compilation"], ctx, "train_step")
    for a, b in zip(expected, compiled(*real)):
        torch.testing.assert_close(a, b)
    stages = json.loads((tmp_path / "summary.json").read_text())["stages"]
    assert [s["stage"] for s in stages] == ["inductor_decomposition", "full_inductor_compilation"]
    assert stages[1].get("compiled") is True and "compiled" not in stages[0]
    assert sorted(p.name for p in tmp_path.glob("*.py")) == ["00_inductor_decomposition.py", "01_full_inductor_compilation.py"]


def test_full_inductor_output_runs_without_autograd(toy):
    gm, ctx, real = toy
    compiled = full_inductor_compilation(inductor_decomposition(gm, ctx), ctx)
    outs = compiled(*real)
    assert all(not o.requires_grad for o in outs)


FC = torch.ops._c10d_functional
ORDERED = {torch.ops.aten.mm.default: "mm", FC.all_gather_into_tensor.default: "all_gather",
           FC.reduce_scatter_tensor.default: "reduce_scatter", FC.wait_tensor.default: "wait"}
"""The ops whose order the compiled train step must keep, by the name Inductor's wrapper calls them by."""
CALLED = re.compile(r"extern_kernels\.(mm)\(|_c10d_functional\.(all_gather|reduce_scatter|wait)_?\w*\.default\(")


def resharded_step(group: str, blocks: int = 4, dim: int = 64, tokens: int = 128) -> fx.GraphModule:
    """A train step shaped like aot_fx_trace's under SimpleFSDP with full activation checkpointing:
    each block all-gathers its bf16 cast shard, forward keeps only block inputs, and backward gathers
    every shard again, recomputes the block and reduce-scatters its weight gradient."""

    def gather(shard):
        return FC.wait_tensor(FC.all_gather_into_tensor(shard.to(torch.bfloat16), 2, group))

    def step(*args):
        shards, x = args[:-1], args[-1]
        inputs = [x]
        for shard in shards:
            inputs.append(torch.relu(inputs[-1] @ gather(shard).t()))
        loss = inputs[-1].float().pow(2).mean()
        grad = (2 * inputs[-1].float() / inputs[-1].numel()).to(torch.bfloat16)
        grads = []
        for i in reversed(range(len(shards))):
            weight, h = gather(shards[i]), inputs[i]
            grad = grad * (torch.relu(h @ weight.t()) > 0)
            grads.append(FC.wait_tensor(FC.reduce_scatter_tensor((grad.t() @ h).float(), "avg", 2, group)))
            if i:  # the batch needs no gradient
                grad = grad @ weight
        return (loss, *reversed(grads))

    shards = [torch.randn(dim // 2, dim) for _ in range(blocks)]
    return make_fx(step, tracing_mode="fake")(*shards, torch.randn(tokens, dim, dtype=torch.bfloat16))


def test_full_inductor_keeps_the_train_step_order(fake_pg):
    """Inductor runs the matmuls and collectives of the train-step graph in the traced order. Its own
    reorderings would start all four forward all-gathers before the first matmul (every gathered
    weight live at once) and, for a larger model, the backward's casts for its re-gathers in the
    forward, or every gradient's reduce-scatter wait at the return (see KEEP_TRAIN_STEP_ORDER)."""
    from torch._inductor.utils import run_and_get_code

    gm = resharded_step(fake_pg)
    traced = [ORDERED[n.target] for n in gm.graph.nodes if n.target in ORDERED]
    ctx = PassContext(cfg=None, meshes=None, device=torch.device("cpu"), num_params=4)
    with torch._inductor.config.patch(force_disable_caches=True):
        _, (code,) = run_and_get_code(full_inductor_compilation, gm, ctx)
    called = [next(g for g in m.groups() if g) for m in CALLED.finditer(code[code.index("def call("):])]
    assert traced.count("mm") == 15 and traced.count("all_gather") == 8 and traced.count("reduce_scatter") == 4
    assert called == traced


SMALL = ("--training.steps", "5", "--training.batch_size", "2", "--training.seq_len", "64", "--metrics.log_freq", "1")
EAGER = ("--compile.mode", "eager")
"""The reference runs say so: the default mode is aot_fx_trace."""
STAGES = {"regional": ["traced", "reshard_after_forward", "recompute_pointwise", "regional_inductor"],
          "full": ["traced", "reshard_after_forward", "recompute_pointwise", "inductor_decomposition", "full_inductor_compilation"]}
OVERLAP = ["separate_gather_group", "transformer_block_bucketing"]
"""What a multi-rank aot_fx_trace job runs by default after resharding (defaults.py)."""


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("backend", ["regional", "full"])
def test_llama3_trains_like_eager(backend, nproc):
    dp = ("--parallelism.dp_shard", str(nproc))
    eager = read_metrics(cached_run((*SMALL, *dp, *EAGER), nproc))
    folder = cached_run((*SMALL, *dp, "--compile.mode", "aot_fx_trace", "--compile.inductor_compilation", backend,
                         "--compile.dump_graphs"), nproc)
    compiled = read_metrics(folder)
    assert len(compiled) == 5
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-4)
    stages = json.loads((folder / "graphs" / "summary.json").read_text())["stages"]
    expected = STAGES[backend][:3] + (OVERLAP if nproc == 2 else []) + STAGES[backend][3:]
    assert [s["stage"] for s in stages] == expected
    assert stages[-1]["compiled"] is True
    # Each pass's wall time on its stage, in the dump and the step-1 record: the time to the first step by pass.
    for stage in stages[1:]:
        key = f"pass_{stage['stage']}_s"
        assert stage["report"][key] == compiled[0][key] > 0, (stage["stage"], stage["report"])
    # Collectives stay visible in every stage: 57 parameter gathers and gradient reduce-scatters, and from
    # resharding on (default policy) 54 gathers again for backward (9 parameters of each of the 6 blocks).
    # The block bucketing then merges them per block: 8 forward gathers (the embedding, the 6 blocks,
    # the final norm with the output) and 6 for backward, one reduce-scatter per forward unit (8).
    for stage in stages:
        gathers = 57 + (54 if stage["stage"] != "traced" else 0)
        counts = {k: v["count"] for k, v in stage["collectives"].items()}
        if nproc == 1:
            assert counts == {}
        elif expected.index(stage["stage"]) <= expected.index("separate_gather_group"):
            assert counts == {"all_gather": gathers, "reduce_scatter": 57}
        else:
            assert counts == {"all_gather": 8 + 6, "reduce_scatter": 8}
    if backend == "regional":
        code = (folder / "graphs" / f"{expected.index('regional_inductor'):02d}_regional_inductor.py").read_text()
        # one compiled region per block's attention in forward and one in backward
        assert len(set(re.findall(r"torch__inductor_standalone_compile_inner\w*", code))) == 12


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["aot", "jit"])
def test_full_inductor_in_aot_and_jit_trains_like_eager(mode):
    """aot and jit compile their forward and backward graphs separately; the aot joint graph is not
    decomposed (a retrace would flatten its tangents into forward inputs)."""
    eager = read_metrics(cached_run((*SMALL, *EAGER)))
    folder = cached_run((*SMALL, "--compile.mode", mode, "--compile.inductor_compilation", "full", "--compile.dump_graphs"))
    assert losses(read_metrics(folder)) == pytest.approx(losses(eager), rel=1e-4)
    stages = [s["stage"] for s in json.loads((folder / "graphs" / "summary.json").read_text())["stages"]]
    passes = ("inductor_decomposition", "full_inductor_compilation")
    # The reshard policy tags the joint graph for the partitioner (in jit, the joint graph is not dumped itself).
    joint = ["joint", "joint_reshard_after_forward"] if mode == "aot" else ["joint_reshard_after_forward"]
    expected = joint + [f"{g}{p}" for g in ("forward", "backward") for p in ("", *(f"_{q}" for q in passes))]
    assert stages == expected


def test_gradient_sums_take_no_forward_marks():
    """The engine's sum of the two gradients reaching `h` runs in no autograd node: it must not take the marks of
    whichever forward op shares the running thread's node count (on CPU the loss's, inside the region here; on
    CUDA, where the count of autograd's device thread starts at 0, block 0's)."""
    from torch.fx.traceback import annotate

    def step(w, x):
        with annotate(region_tag("feed_forward")):
            h = x * w
            loss = (h + h.tanh()).sum()
        return (loss.detach(), *torch.autograd.grad(loss, [w]))

    mode = FakeTensorMode()
    fake = [mode.from_tensor(torch.randn(4, DIM)).requires_grad_(), mode.from_tensor(torch.randn(4, DIM))]
    with mode, fx_traceback.preserve_node_meta(), BackwardSeqNr():
        gm = make_fx(step, tracing_mode="real")(*fake)
    copy_marks_to_backward(gm)
    forward = ancestors(next(n for n in gm.graph.nodes if n.op == "output").args[0][0])
    sums = [n for n in gm.graph.nodes if n.target == torch.ops.aten.add.Tensor and n not in forward]
    assert len(sums) == 1 and REGION_KEY not in (sums[0].meta.get("custom") or {})
    tanh_backward = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.tanh_backward.default)
    assert REGION_KEY in tanh_backward.meta["custom"]
