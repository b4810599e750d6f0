"""The built-in auto-sharding solver: plan quality on fake meshes, cost formulas, errors, speed."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from graph_trainer.autoparallel.costs import CommModel, backward_target, grad_spec
from graph_trainer.autoparallel.strategies import Strategy
from graph_trainer.config import ConfigError, parse_args
from graph_trainer.plan import make_plan

LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def plan(*flags: str) -> dict:
    return make_plan(parse_args(["--config", "configs/llama3_debug.toml", *flags]))


def test_collective_formulas():
    cm = CommModel((4,), (100e9,), 10e-6)
    nbytes = 4e8
    t, colls = cm.redistribute(nbytes, ("S0",), ("R",))
    assert colls == (("all_gather", nbytes),) and t == pytest.approx(10e-6 + 0.75 * nbytes / 100e9)
    t, colls = cm.redistribute(nbytes, ("P",), ("R",))
    assert colls[0][0] == "all_reduce" and t == pytest.approx(10e-6 + 1.5 * nbytes / 100e9)
    t, colls = cm.redistribute(nbytes, ("P",), ("S1",))
    assert colls[0][0] == "reduce_scatter" and t == pytest.approx(10e-6 + 0.75 * nbytes / 100e9)
    assert cm.redistribute(nbytes, ("R",), ("S0",))[0] == 0.0
    assert math.isinf(cm.redistribute(nbytes, ("R",), ("P",))[0])
    # batch-parallel matmul: the replicated weight's gradient is partial, reduced back to its shard
    mm = Strategy(outs=(("S0",),), ins=(("S0",), ("R",)))
    assert grad_spec(mm, 1) == ("P",) and backward_target(("S0",), ("P",)) == ("S0",)
    assert backward_target(("P",), ("R",)) == ("R",)


@pytest.mark.slow
def test_dp_mesh_gives_fsdp():
    p = plan("--model.flavor", "8B", "--training.seq_len", "8192", "--training.batch_size", "8", "--parallelism.dp_shard", "8")
    assert p["batch_spec"] == ["S0"]
    for name in LINEARS:
        entry = p["params"][f"layers.*.{name}.weight"]
        assert entry["storage"][0].startswith("S"), (name, entry)  # sharded storage
        assert entry["compute"] == ["R"], (name, entry)  # gathered for compute
    comm = p["predicted"]["communication"]
    assert comm["all_gather (forward)"]["count"] >= 7 * 32 and comm["reduce_scatter (backward)"]["count"] >= 7 * 32
    assert p["program"]["lp_integral"] and p["program"]["total_s"] < 10


@pytest.mark.slow
def test_tp_mesh_gives_column_then_row_parallel():
    p = plan("--model.flavor", "8B", "--training.seq_len", "2048", "--training.batch_size", "1",
             "--parallelism.dp_shard", "1", "--parallelism.tp", "2", "--compile.autoparallel_memory_budget", "70GiB")
    compute = {n: p["params"][f"layers.*.{n}.weight"]["compute"] for n in LINEARS}
    # nn.Linear weights are [out, in]: column-parallel shards dim 0, row-parallel dim 1
    assert compute["feed_forward.w1"] == compute["feed_forward.w3"] == ["S0"]
    assert compute["feed_forward.w2"] == ["S1"]
    assert compute["attention.wq"] == ["S0"] and compute["attention.wo"] == ["S1"]
    assert p["params"]["output.weight"]["compute"] == ["S0"]


@pytest.mark.slow
def test_2d_mesh_shards_on_both_dims():
    p = plan("--model.flavor", "8B", "--training.seq_len", "8192", "--training.batch_size", "4",
             "--parallelism.dp_shard", "4", "--parallelism.tp", "2")
    assert p["batch_spec"] == ["S0", "R"]
    for name in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
        entry = p["params"][f"layers.*.{name}.weight"]
        assert entry["storage"][0].startswith("S") and entry["compute"][0] == "R", entry  # FSDP on dp_shard
    compute = {n: p["params"][f"layers.*.feed_forward.{n}.weight"]["compute"][1] for n in ("w1", "w2", "w3")}
    assert compute == {"w1": "S0", "w2": "S1", "w3": "S0"}  # Megatron MLP on tp


def test_memory_budget_forces_sharding():
    loose = plan("--parallelism.dp_shard", "2")
    tight = plan("--parallelism.dp_shard", "2", "--compile.autoparallel_memory_budget", "0.05GiB")
    sharded = lambda p: sum(e["count"] for e in p["params"].values() if e["storage"] != ["R"])  # noqa: E731
    assert tight["predicted"]["memory_per_rank_bytes"] <= 0.05 * 1024**3
    assert sharded(tight) > sharded(loose)
    assert loose["params"]["norm.weight"]["storage"] == ["R"]  # small parameters stay replicated when memory allows


def test_infeasible_budget_names_the_smallest():
    with pytest.raises(ConfigError, match=r"need at least 0\.05 GiB.*autoparallel_memory_budget 0\.05GiB"):
        plan("--parallelism.dp_shard", "2", "--compile.autoparallel_memory_budget", "0.01GiB")


def test_bad_budget_format():
    with pytest.raises(ConfigError, match="fraction"):
        plan("--parallelism.dp_shard", "2", "--compile.autoparallel_memory_budget", "lots")


def test_untraceable_op_is_named_with_its_module():
    from graph_trainer.autoparallel.trace import trace_model

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            h = self.proj(x.float().unsqueeze(-1).expand(-1, -1, 8))
            return h[h > 0].sum() * h  # data-dependent shape

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Odd()])

        def forward(self, tokens):
            return self.layers[0](tokens)

    with torch.device("meta"):
        root = Root()
    with pytest.raises(ConfigError, match=r"cannot handle module 'layers.0'"):
        trace_model(root, (2, 4), torch.float32, torch.device("cpu"))
