"""ep_overlap: each MoE layer's tokens in two chunks whose all-to-alls run while the other chunk computes.

Graph tests trace DeepSeek V3's and Qwen3's MoE debug models at dp_shard 2 x ep 2 in this process on a
fake process group. Runs on gloo: 2 ranks (dp_shard 2 x ep 2) train like the runs without the pass
within a relative 1e-6, 4 ranks (with TP and async_tp too, in test_async_tp.py) bitwise.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import fx

from helpers import cached_run, grad_norms, launch, losses, read_metrics
from traced_step import trace_step

from graph_trainer.config import ConfigError, JobConfig
from graph_trainer.graph_dump import is_collective
from graph_trainer.passes.bucketing_compat import WAIT
from graph_trainer.passes.ep_overlap import ALL_TO_ALL, ep_overlap, layer_spans, node_chunk
from graph_trainer.passes.validate import check_passes

MOE_LAYERS = 2
PER_CHUNK = 3 + 2
"""All-to-alls of one chunk of one MoE layer: rows, counts and outputs in forward; rows and outputs in backward."""


@pytest.fixture(scope="module")
def fake_pg():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


MODELS = {
    "deepseek_v3": ("--model.n_layers", "3"),
    "qwen3": ("--model.flavor", "debugmodel_moe", "--model.n_layers", "2"),
}
"""Each with two MoE layers (DeepSeek V3's first layer is dense)."""


def _trace(model: str, *flags: str) -> tuple[fx.GraphModule, object]:
    return trace_step(model, 2, 1, 2, *MODELS[model], *flags)


def _overlapped(gm: fx.GraphModule) -> tuple[int, int]:
    """(all-to-alls, those with compute of the other chunk of their layer between their issue and wait)."""
    order = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    issued = gm.graph.find_nodes(op="call_function", target=ALL_TO_ALL)
    hidden = 0
    for node in issued:
        wait = next(u for u in node.users if u.target is WAIT)
        other = 1 - node_chunk(node)
        between = order[pos[node] + 1 : pos[wait]]
        hidden += any(n.op == "call_function" and not is_collective(n) and n.target is not WAIT
                      and node_chunk(n) == other for n in between)
    return len(issued), hidden


@pytest.mark.parametrize("model", list(MODELS))
def test_split_layers_take_turns_between_chunks(fake_pg, model):
    gm, ctx = _trace(model, "--compile.passes", "ep_overlap")
    count, hidden = _overlapped(gm)
    assert count == MOE_LAYERS * 2 * PER_CHUNK
    assert {node_chunk(n) for n in gm.graph.find_nodes(op="call_function", target=ALL_TO_ALL)} == {0, 1}
    # As traced, chunk 0's dispatch, experts and combine run before chunk 1 starts: nothing to hide behind.
    assert hidden == 0
    ep_overlap(gm, ctx)
    count, hidden = _overlapped(gm)
    # After: every all-to-all, in forward and in backward, runs beside compute of the other chunk.
    assert hidden == count and len(layer_spans(gm)) == 2 * MOE_LAYERS
    assert ctx.report["ep_overlap"]["moe_chunks"] == 2 and ctx.report["ep_overlap"]["moe_spans_interleaved"] == 4
    # dp_shard 2 x ep 2 on 2 ranks: the ep group is the world group, which the FSDP collectives use too.
    groups = {n.args[3] for n in gm.graph.find_nodes(op="call_function", target=ALL_TO_ALL)}
    assert len(groups) == 1 and groups != {dist.group.WORLD.group_name}


def test_unsplit_layers_trace_without_chunks(fake_pg):
    gm, _ = _trace("deepseek_v3")
    issued = gm.graph.find_nodes(op="call_function", target=ALL_TO_ALL)
    assert len(issued) == MOE_LAYERS * PER_CHUNK and {node_chunk(n) for n in issued} == {None}


@pytest.mark.parametrize("name, degree", [("ep_overlap", "ep"), ("async_tp", "tp")])
def test_refused_without_the_parallelism_it_overlaps(name, degree):
    cfg = JobConfig()
    cfg.compile.mode, cfg.compile.passes, cfg.compile.inductor_compilation = "aot_fx_trace", [name], "none"
    with pytest.raises(ConfigError) as e:
        check_passes(cfg, "cpu")
    assert str(e.value) == (f"pass {name!r} needs --parallelism.{degree} > 1 and this job has --parallelism.{degree} 1; "
                            f"raise it or remove {name!r} from --compile.passes")


RUN = ("--model.name", "deepseek_v3", "--model.n_layers", "3", "--training.batch_size", "4", "--training.seq_len", "64",
       "--training.steps", "3", "--metrics.log_freq", "1", "--parallelism.dp_shard", "2", "--parallelism.ep", "2")


@pytest.mark.slow
def test_two_ranks_train_like_unsplit():
    # Each token is routed, dispatched and combined as without the split (no capacity: nothing dropped).
    # The reduction order is not quite unchanged: a weight gradient is now the sum of two chunks' sums
    # over tokens. Whether that rounds like one sum depends on the CPU's kernels: bit for bit with
    # ATEN_CPU_CAPABILITY=avx2, one ulp off (6e-8 relative) on the second loss with AVX-512; the bound
    # is a relative 1e-6 (docs/modes-and-backends.md). The forward is the same per token: step 1 is equal.
    ref = read_metrics(cached_run((*RUN, "--compile.passes", "none"), 2))
    got = read_metrics(cached_run((*RUN, "--compile.passes", "ep_overlap"), 2))
    assert losses(got)[0] == losses(ref)[0]
    for a, b in ((losses(got), losses(ref)), (grad_norms(got), grad_norms(ref))):
        assert len(a) == len(b) == 3 and all(abs(x - y) <= 1e-6 * abs(y) for x, y in zip(a, b)), (a, b)
    assert [r["dropped_tokens"] for r in got] == [r["dropped_tokens"] for r in ref] == [0, 0, 0]
    assert got[0]["moe_chunks"] == 2 and got[0]["all_to_alls_on_twin"] == MOE_LAYERS * 2 * PER_CHUNK


def test_cli_refuses_ep_overlap_without_ep_in_one_line(tmp_path):
    proc = launch(["train", "--job.dump_folder", str(tmp_path / "out"), "--model.name", "deepseek_v3",
                   "--compile.passes", "ep_overlap"], timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["graph-trainer: error: pass 'ep_overlap' needs --parallelism.ep > 1 and this job has "
                     "--parallelism.ep 1; raise it or remove 'ep_overlap' from --compile.passes"], proc.stderr
    assert "Traceback" not in proc.stdout and not (tmp_path / "out").exists()
