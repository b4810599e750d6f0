"""The traced step stored in the compile cache (graph_trainer/capture/trace_cache.py).

Graph tests trace the debug models as rank 0 of 2 on a fake process group; the end-to-end restarts (a warm
start loads the trace and trains bit for bit the same, on 1 and 2 gloo ranks) are in test_compile_cache.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from traced_step import trace_step

from graph_trainer.capture.trace_cache import TraceCache, _rank, trace_key
from graph_trainer.compile_cache import CompileCache, graph_fingerprint
from graph_trainer.config import parse_args
from graph_trainer.parallel.mesh import Degrees
from graph_trainer.passes.compat import LazyGraphModule
from graph_trainer.passes.registry import apply_passes, run_teardowns
from graph_trainer.train_step import ParamSpec


@pytest.fixture(scope="module")
def fake_pg():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _entry(folder) -> TraceCache:
    return TraceCache(CompileCache(folder), "0" * 64, {})


def _marks(gm) -> list:
    return [(n.name, n.meta.get("custom"), n.meta.get("seq_nr")) for n in gm.graph.nodes]


@pytest.mark.parametrize("model, ep", [("llama3", 1), ("deepseek_v3", 2)])
def test_a_stored_trace_loads_as_the_same_graph_and_the_passes_see_the_same_marks(fake_pg, tmp_path, model, ep):
    gm, ctx = trace_step(model, 2, 1, ep)
    _entry(tmp_path).store(gm)
    entry = _entry(tmp_path)
    loaded = entry.load()
    assert entry.outcome == "hit"
    # lazy, as make_fx's: an eager module writes its code at every recompile of the passes (2.7 s against 1.2 s, 8B)
    assert isinstance(loaded, LazyGraphModule)
    # ops, arguments and every value's shape, stride, dtype and device; then the marks the passes read
    assert graph_fingerprint(loaded) == graph_fingerprint(gm)
    assert _marks(loaded) == _marks(gm) and any(custom for _, custom, _ in _marks(gm))
    # the overlap schedule plans from the block marks: the same schedule on both
    schedule = ["separate_gather_group", "transformer_block_bucketing"]
    fresh, again = (apply_passes(g, schedule, ctx, "train_step") for g in (gm, loaded))
    assert graph_fingerprint(fresh) == graph_fingerprint(again)


def test_a_trace_stored_aside_is_the_graph_as_traced_whatever_the_passes_do_after(fake_pg, tmp_path):
    """The forked store pickles the step as it was at the fork, while the rank's passes go on changing it."""
    gm, ctx = trace_step("llama3", 2, 1, 1)
    traced = graph_fingerprint(gm)
    _entry(tmp_path / "here").store(gm)
    _entry(tmp_path / "aside").store_aside(gm)
    changed = apply_passes(gm, ["separate_gather_group", "transformer_block_bucketing"], ctx, "train_step")
    assert graph_fingerprint(changed) != traced
    run_teardowns()  # the run's end waits for the child
    (here,), (aside,) = (list((tmp_path / f).iterdir()) for f in ("here", "aside"))
    assert aside.read_bytes() == here.read_bytes()
    assert graph_fingerprint(_entry(tmp_path / "aside").load()) == traced


def test_a_truncated_entry_is_one_warning_and_a_fresh_trace(fake_pg, tmp_path, caplog):
    gm, _ = trace_step("llama3", 2, 1, 1)
    _entry(tmp_path).store(gm)
    (path,) = tmp_path.iterdir()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    entry = _entry(tmp_path)
    with caplog.at_level(logging.WARNING, logger="graph_trainer"):
        assert entry.load() is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "refused (truncated" in warnings[0] and "tracing afresh" in warnings[0]
    assert entry.outcome.startswith("refused (truncated: ")
    assert _entry(tmp_path / "empty").load() is None  # no entry: a miss, no warning
    assert len(caplog.records) == 1


def test_the_key_follows_what_the_trace_depends_on(fake_pg):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    cpu = torch.device("cpu")

    def key(flags=(), placements=(Shard(0),), shape=(8, 4)) -> str:
        cfg = parse_args(["--compile.inductor_compilation", "full", *flags])
        spec = ParamSpec("w", mesh, placements, torch.Size((16, 4)), (4, 1))
        return trace_key(cfg, [spec], [torch.empty(shape)], cpu, Degrees(1, 2, 1, 1))[0]

    # what a restart may change: where it writes, how long it runs, checkpoints, metrics, profiles, the cache folder;
    # and precompile's fake process group, which traces the real one's graph
    same = [key(("--training.steps", "7")), key(("--job.dump_folder", "/elsewhere")), key(("--checkpoint.enable",)),
            key(("--metrics.log_freq", "5")), key(("--profiling.enable",)), key(("--compile.cache_dir", "/c")),
            key(("--compile.dump_graphs",)), key(("--comm.mode", "fake", "--comm.fake_world_size", "2"))]
    assert set(same) == {key()}
    changed = [key(("--model.n_layers", "3")), key(("--activation_checkpoint.mode", "full")),
               key(("--training.max_norm", "0.5")), key(("--compile.passes", "auto_bucketing")),
               key(placements=(Replicate(),)), key(shape=(4, 8))]
    assert len({key(), *changed}) == len(changed) + 1


def test_the_rank_is_in_the_key_where_the_ranks_graphs_differ(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    for rank in (0, 3):
        monkeypatch.setattr(dist, "get_rank", lambda rank=rank: rank)
        # one split dimension: every rank's collectives use the same groups, one entry serves all
        assert _rank(Degrees(1, 4, 1, 1)) == [0, 4]
        # two: each rank's groups are its own
        assert _rank(Degrees(1, 2, 2, 1)) == [rank, 4] and _rank(Degrees(2, 2, 1, 1)) == [rank, 4]


def test_no_trace_is_stored_where_the_backend_stores_no_compile(tmp_path):
    cfg = parse_args(["--compile.inductor_compilation", "none", "--compile.cache_dir", str(tmp_path)])
    assert TraceCache.of(cfg, [], [], torch.device("cpu"), Degrees(1, 1, 1, 1)) is None
    cfg = parse_args(["--compile.inductor_compilation", "full", "--compile.cache_dir", "off"])
    assert TraceCache.of(cfg, [], [], torch.device("cpu"), Degrees(1, 1, 1, 1)) is None
