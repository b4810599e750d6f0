"""The compile cache (graph_trainer/compile_cache.py) and `graph-trainer precompile`.

The end-to-end tests reuse the full-Inductor runs of test_inductor_passes.py's parity test through
`cached_run` (same arguments): those runs are the cold starts, and their default cache
(<dump_folder>/compile_cache) is what the warm starts here load.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from helpers import cached_run, grad_norms, launch, losses, read_metrics

from graph_trainer import cli
from graph_trainer.compile_cache import CompileCache, cache_key, cacheable_inputs
from graph_trainer.passes.inductor import _compile_whole, inductor_decomposition
from graph_trainer.passes.registry import PassContext

SMALL = ("--training.steps", "5", "--training.batch_size", "2", "--training.seq_len", "64", "--metrics.log_freq", "1")


def full_inductor(nproc: int) -> tuple[str, ...]:
    return (*SMALL, "--parallelism.dp_shard", str(nproc), "--compile.mode", "aot_fx_trace",
            "--compile.inductor_compilation", "full", "--compile.dump_graphs")


def restart(nproc: int) -> tuple[str, ...]:
    """The job of `full_inductor(nproc)` started again without dumping its graphs (a start that dumps runs the passes
    that make the dumps, and does not load the decided step)."""
    return tuple(a for a in full_inductor(nproc) if a != "--compile.dump_graphs")


def entries(folder: Path) -> dict[str, int]:
    """The cache's entries by name, with their modification times (a rewritten entry changes it); the traced
    steps' are under traces/."""
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("*.bin")}


def train(args: list[str], nproc: int = 1):
    proc = launch(["train", *args], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_second_start_loads_every_compiled_graph(tmp_path):
    cold_folder = cached_run(full_inductor(1))
    cold = read_metrics(cold_folder)
    stored = entries(cold_folder / "compile_cache")
    # 6 layers: block reuse compiles the distinct pieces (more than one), each stored as an entry of its own
    assert cold[0]["compile_cache"] == "miss" and cold[0]["compile_cache_entries_written"] == len(stored) > 1
    assert cold[0]["decomposed_pieces"] == cold[0]["compiled_blocks"] == len(stored)
    # the trace, and what the passes and the compile made of it (the decided step), stored beside the compiles
    assert (cold[0]["trace_cache"], cold[0]["step_cache"]) == ("miss", "miss")
    assert len(entries(cold_folder / "compile_cache" / "traces")) == len(entries(cold_folder / "compile_cache" / "steps")) == 1
    proc = train(["--job.dump_folder", str(tmp_path), *restart(1), "--compile.cache_dir", str(cold_folder / "compile_cache")])
    warm = read_metrics(tmp_path)
    assert warm[0]["compile_cache"] == "hit"
    assert (warm[0]["compile_cache_entries_loaded"], warm[0]["compile_cache_entries_written"]) == (len(stored), 0)
    # the decided step ran: neither traced nor loaded the trace, no pass ran, nothing was decomposed or compiled
    assert (warm[0]["step_cache"], warm[0]["trace_cache"]) == ("hit", "unused")
    assert "loaded the decided step" in proc.stderr and "the train step:" not in proc.stderr and "pass " not in proc.stderr
    assert "decomposed_pieces" not in warm[0] and "compile cache: miss" not in proc.stderr
    # the step's figures as the cold start reported them
    assert (warm[0]["compiled_blocks"], warm[0]["block_pieces"], warm[0]["layers"]) == (
        cold[0]["compiled_blocks"], cold[0]["block_pieces"], cold[0]["layers"])
    assert entries(cold_folder / "compile_cache") == stored
    assert losses(warm) == losses(cold) and grad_norms(warm) == grad_norms(cold)

    # The decided step cut short, and an entry the decomposition counted on cut short: the stored trace is loaded, the
    # passes run, the cut piece, left as traced, is decomposed and compiled; both refusals are one warning each.
    cache = tmp_path / "cut"
    shutil.copytree(cold_folder / "compile_cache", cache)
    for cut in (cache / sorted(stored)[0], next((cache / "steps").glob("*.bin"))):
        cut.write_bytes(cut.read_bytes()[:1000])
    proc = train(["--job.dump_folder", str(tmp_path / "again"), *restart(1), "--compile.cache_dir", str(cache)])
    again = read_metrics(tmp_path / "again")
    assert again[0]["step_cache"].startswith("refused (truncated") and again[0]["trace_cache"] == "hit"
    assert again[0]["compile_cache"].startswith("refused (truncated")
    assert proc.stderr.count("; tracing the step") == proc.stderr.count("; compiling afresh") == 1 and "Traceback" not in proc.stderr
    assert (again[0]["compile_cache_entries_loaded"], again[0]["compile_cache_entries_written"]) == (len(stored) - 1, 1)
    assert losses(again) == losses(cold) and grad_norms(again) == grad_norms(cold)


@pytest.mark.slow
def test_two_gloo_ranks_restart_into_the_step_their_passes_decided(tmp_path):
    gloo_folder = cached_run(full_inductor(2), nproc=2)
    gloo = read_metrics(gloo_folder)
    cache = tmp_path / "cache"
    shutil.copytree(gloo_folder / "compile_cache", cache)
    # the overlap schedule (the all-gathers on twin communicators, per-block buckets) on both ranks
    assert gloo[0]["step_cache"] == "miss" and gloo[0]["gathers_on_own_group"] > 0
    proc = train(["--job.dump_folder", str(tmp_path / "job"), *restart(2), "--compile.cache_dir", str(cache)], nproc=2)
    warm = read_metrics(tmp_path / "job")
    # both ranks ran it (a rank that planned again would have stored its own decided step or trace, and a rank that
    # disagreed refuses on both), over twin communicators made again in the order the passes made them
    assert (warm[0]["step_cache"], warm[0]["compile_cache"]) == ("hit", "hit") and "pass " not in proc.stderr
    assert warm[0]["gathers_on_own_group"] == gloo[0]["gathers_on_own_group"]
    assert entries(cache / "steps") == entries(gloo_folder / "compile_cache" / "steps")
    assert losses(warm) == losses(gloo) and grad_norms(warm) == grad_norms(gloo)


@pytest.mark.slow
def test_precompile_on_the_fake_process_group_warms_a_two_rank_gloo_job(tmp_path):
    gloo_folder = cached_run(full_inductor(2), nproc=2)
    gloo = read_metrics(gloo_folder)
    cache = tmp_path / "cache"
    proc = launch(["precompile", "--job.dump_folder", str(tmp_path / "pre"), *full_inductor(2), "--compile.cache_dir", str(cache)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "precompile: rank 0: miss (rank 0 stands for all 2)" in proc.stdout
    stored = entries(cache)
    pre_traces = entries(cache / "traces")
    # Both gloo ranks stored what they compiled in the cold run: the same keys as the one fake rank's,
    # so the fake trace has the real ranks' graphs (group names, shapes) and rank 0 stands for rank 1.
    assert set(stored) == set(entries(gloo_folder / "compile_cache"))
    train(["--job.dump_folder", str(tmp_path / "job"), *full_inductor(2), "--compile.cache_dir", str(cache)], nproc=2)
    warm = read_metrics(tmp_path / "job")
    assert warm[0]["compile_cache"] == "hit" and warm[0]["compile_cache_entries_loaded"] == len(stored)
    # Rank 1 logs only warnings: that it loaded too shows in the cache, which a rank that compiled would have written to.
    assert entries(cache) == stored
    assert losses(warm) == losses(gloo) and grad_norms(warm) == grad_norms(gloo)
    # Nor did either rank trace: the fake rank's traced step (one entry, a mesh of one dimension) served both, and a
    # rank that traced would have stored an entry of its own or rewritten that one.
    assert warm[0]["trace_cache"] == "hit"
    assert len(entries(cache / "traces")) == 1 and entries(cache / "traces") == pre_traces


def _step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = torch.relu(x @ w)
    return y.sum(), y * 2


def _graph(rows: int = 8) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """A small graph as the compile gets it: traced, then decomposed by the pass that precedes it."""
    inputs = [torch.randn(rows, 16), torch.randn(16, 4)]
    gm = make_fx(_step, tracing_mode="fake")(*inputs)
    return inductor_decomposition(gm, PassContext(cfg=None, meshes=None, device=torch.device("cpu"))), inputs


def _ctx(cache_dir: Path) -> PassContext:
    cfg = SimpleNamespace(compile=SimpleNamespace(cache_dir=str(cache_dir)), job=SimpleNamespace(dump_folder=""))
    return PassContext(cfg=cfg, meshes=None, device=torch.device("cpu"))


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> SimpleNamespace:
    dense = SimpleNamespace(shape=shape, mesh_dim_names=names)
    return SimpleNamespace(dense=dense, sparse=None)


def test_key_changes_with_the_mesh_graph_inputs_and_options():
    gm, inputs = _graph()
    cpu = torch.device("cpu")
    fakes = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    dp2 = _mesh((2,), ("dp_shard",))

    def key(graph=gm, vals=fakes, options=None, meshes=dp2) -> str:
        return cache_key(graph, vals, options, cpu, meshes)[0]

    assert key() == key(graph=_graph()[0])  # the same graph traced again: the same key
    other_gm, _ = _graph(rows=4)
    changed = [
        key(meshes=_mesh((4,), ("dp_shard",))),
        key(meshes=_mesh((2,), ("tp",))),
        key(meshes=_mesh((2, 2), ("dp_shard", "tp"))),
        key(options={"config_patches": {"reorder_for_locality": False}}),
        key(graph=other_gm, vals=[n.meta["val"] for n in other_gm.graph.find_nodes(op="placeholder")]),
        key(vals=[fakes[0], fakes[1].t().contiguous().t()]),  # same shape, other strides
    ]
    assert len({key(), *changed}) == len(changed) + 1


def test_cacheable_inputs_move_every_fake_tensor_into_one_mode():
    """Inputs that hold fake tensors in a container (a traced value of several tensors) are converted too: one left in
    the tracing mode beside the converted ones made the compile fail on a mode mismatch (DeepSeek V3 16B, flex
    attention, 2 x H100), with the cache on or off."""
    tracing_mode = FakeTensorMode()
    with tracing_mode:
        a, b = torch.empty(3, 4), torch.empty(2, dtype=torch.int32)
    fresh = cacheable_inputs([a, (b, 3), 5])
    assert detect_fake_mode(fresh) is not tracing_mode
    assert fresh[1][0].shape == (2,) and fresh[1][0].dtype == torch.int32 and fresh[1][1:] == (3,) and fresh[2] == 5


def test_a_truncated_entry_is_one_warning_and_a_fresh_compile(tmp_path, caplog):
    gm, inputs = _graph()
    expected = _step(*inputs)
    ctx = _ctx(tmp_path)
    compiled = _compile_whole(gm, ctx)
    assert ctx.report["full_inductor_compilation"] == {"compile_cache": "miss", "compile_cache_entries_loaded": 0,
                                                       "compile_cache_entries_written": 1}
    (entry,) = tmp_path.iterdir()
    ctx = _ctx(tmp_path)
    loaded = _compile_whole(gm, ctx)
    assert ctx.report["full_inductor_compilation"]["compile_cache"] == "hit"
    assert all(torch.equal(a, b) for a, b in zip(loaded(*inputs), compiled(*inputs)))

    data = entry.read_bytes()
    entry.write_bytes(data[: len(data) // 2])
    ctx = _ctx(tmp_path)
    with caplog.at_level(logging.WARNING, logger="graph_trainer"):
        again = _compile_whole(gm, ctx)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "refused (truncated" in warnings[0] and "\n" not in warnings[0]
    figures = ctx.report["full_inductor_compilation"]
    assert figures["compile_cache"].startswith("refused (truncated: ") and figures["compile_cache_entries_written"] == 1
    out = again(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(out, compiled(*inputs)))
    # Against eager: the elementwise output after the same aten mm is bitwise equal; the sum is Inductor's
    # own reduction, whose order may differ from eager's: float32 rounding over 32 terms stays below 1e-6.
    assert torch.equal(out[1], expected[1])
    torch.testing.assert_close(out[0], expected[0], rtol=1e-6, atol=0)
    assert CompileCache(tmp_path).load(entry.stem) is not None  # the entry was written whole again


def test_a_corrupt_entry_is_refused_and_a_missing_one_is_a_miss(tmp_path):
    cache = CompileCache(tmp_path)
    assert cache.load("0" * 64) is None
    gm, _ = _graph()
    _compile_whole(gm, _ctx(tmp_path))
    (entry,) = tmp_path.iterdir()
    data = bytearray(entry.read_bytes())
    data[-10] ^= 0xFF
    entry.write_bytes(bytes(data))
    with pytest.raises(Exception, match="checksum mismatch"):
        cache.load(entry.stem)


@pytest.mark.parametrize("argv, needle", [
    (["--compile.inductor_compilation", "full", "--parallelism.dp_shard", "1", "--compile.cache_dir", "off"], "--compile.cache_dir turns off"),
    (["--compile.inductor_compilation", "none", "--parallelism.dp_shard", "1"], "use --compile.inductor_compilation full"),
    (["--compile.inductor_compilation", "full"], "--comm.fake_world_size N"),  # dp_shard -1: the world size is torchrun's
])
def test_precompile_refuses_a_job_it_cannot_cache(argv, needle, capsys):
    assert cli.main(["precompile", *argv]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
