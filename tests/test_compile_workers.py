"""Compile workers (graph_trainer/passes/compile_workers.py): the distinct pieces of a block-reused step compiled in
worker processes into the compile cache, loaded by the full compile; what a worker cannot compile the pass compiles."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import fx

from helpers import cached_run, grad_norms, launch, losses, read_metrics
from test_block_compile import counting_fx_compile, deep_step
from test_compile_cache import entries, full_inductor

from graph_trainer.compile_cache import CompileCache
from graph_trainer.config import parse_args
from graph_trainer.passes import compile_workers, inductor, registry
from graph_trainer.passes.registry import apply_passes


@torch.library.custom_op("gt_test::unknown_to_workers", mutates_args=())
def _unknown(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_unknown.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.slow
def test_workers_compile_every_piece_of_a_two_rank_job_and_it_trains_bit_for_bit(tmp_path):
    """Each gloo rank's worker compiles every distinct piece (the collectives' process groups registered under the
    ranks' own names on its fake process group), under the keys the ranks compile them under themselves; the
    ranks load them and train as they do alone."""
    alone = cached_run(full_inductor(2), nproc=2)
    proc = launch(["train", "--job.dump_folder", str(tmp_path), *full_inductor(2), "--compile.compile_workers", "1"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cold, warm = read_metrics(alone), read_metrics(tmp_path)
    stored = entries(tmp_path / "compile_cache")
    assert set(stored) == set(entries(alone / "compile_cache"))
    first = warm[0]
    assert first["compile_workers"] == 1 and first["worker_compiled_pieces"] == first["compiled_blocks"] == len(stored) > 1
    # started by the command before its imports (worker_processes.start_early), taken by the compile
    assert first["compile_workers_started_early"] is True and first["compile_workers_ready_s"] > 0
    # the rank decomposed and compiled nothing itself; what the workers made counts as a miss, written this start
    assert first["decomposed_pieces"] == 0 and first["compile_cache"] == "miss"
    assert (first["compile_cache_entries_loaded"], first["compile_cache_entries_written"]) == (0, len(stored))
    assert proc.stderr.count("stored by a compile worker") == len(stored) and "compile workers:" in proc.stderr
    assert "failed, compiled here instead" not in proc.stderr
    assert losses(warm) == losses(cold) and grad_norms(warm) == grad_norms(cold)


def _job(fn, *inputs: torch.Tensor) -> compile_workers.Job:
    gm = fx.symbolic_trace(fn)
    for node, x in zip(gm.graph.find_nodes(op="placeholder"), inputs):
        node.meta["val"] = x
    return compile_workers.Job("k" + "0" * 63, {}, gm, None)


def test_a_piece_a_worker_cannot_compile_and_a_dead_worker_are_reported_not_raised(tmp_path):
    workers = compile_workers.CompileWorkers(1)
    cache = CompileCache(tmp_path)
    try:
        x = torch.randn(4)
        # an op the worker's process does not register: it answers with the error and takes the next job
        outcomes = workers.compile([_job(lambda x: torch.ops.gt_test.unknown_to_workers(x), x)], cache)
        assert "unknown_to_workers" in outcomes["k" + "0" * 63]
        workers.procs[0].kill()
        workers.procs[0].wait()
        outcomes = workers.compile([_job(lambda x: x + 1, x)], cache)
        assert outcomes["k" + "0" * 63].startswith("the worker exited")
    finally:
        workers.close()
    assert not list(tmp_path.glob("*.bin")) and not workers.folder.exists()


def test_kept_workers_compile_a_second_batch(tmp_path):
    """Workers lent to several compiles (a pipeline rank's stage graphs) stay once a batch is done: the next batch is
    compiled by the same processes, not answered with "the worker exited"."""
    workers = compile_workers.CompileWorkers(1)
    workers.kept = True
    cache = CompileCache(tmp_path)
    x = torch.randn(4)
    try:
        first = workers.compile([_job(lambda x: x + 1, x)], cache)
        job = _job(lambda x: x * 3, x)
        job.key = "j" + "0" * 63
        second = workers.compile([job], cache)
    finally:
        workers.close()
    assert (first, second) == ({"k" + "0" * 63: ""}, {"j" + "0" * 63: ""})
    assert len(list(tmp_path.glob("*.bin"))) == 2


PP_INTERLEAVED = ("--model.n_layers", "4", "--training.batch_size", "4", "--training.seq_len", "64", "--training.steps", "2",
                  "--parallelism.pp", "2", "--parallelism.pp_schedule", "Interleaved1F1B", "--parallelism.pp_microbatches", "4",
                  "--compile.mode", "aot_fx_trace", "--compile.inductor_compilation", "full")


@pytest.mark.slow
def test_a_pipeline_rank_lends_one_set_of_workers_to_all_its_stage_graphs(tmp_path):
    """Interleaved1F1B: each rank compiles four graphs (two stages, forward and backward). The workers started with
    the job serve all four, each graph cut into pieces, which the first stage's compile leaves for the second: the
    rank compiles nothing itself, and trains bit for bit as with each graph compiled whole by the rank."""
    alone = cached_run((*PP_INTERLEAVED, "--compile.compile_workers", "0"), nproc=2)
    proc = launch(["train", "--job.dump_folder", str(tmp_path), *PP_INTERLEAVED, "--compile.compile_workers", "1"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole, lent = read_metrics(alone)[0], read_metrics(tmp_path)[0]
    assert whole["compiled_blocks"] == whole["block_pieces"] == 4
    # the ranks share the CPU cache folder: what the other rank stored first is loaded, not compiled again
    assert lent["compiled_blocks"] > 4 and lent["decomposed_pieces"] == 0
    assert lent["worker_compiled_pieces"] + lent["compile_cache_entries_loaded"] == lent["compiled_blocks"]
    assert lent["compile_workers"] == 1 and lent["compile_workers_started_early"] is True
    assert "failed, compiled here instead" not in proc.stderr
    cold, warm = read_metrics(alone), read_metrics(tmp_path)
    assert losses(warm) == losses(cold) and grad_norms(warm) == grad_norms(cold)


class _Failing:
    """Workers whose every job fails (`why`), as a worker that crashes on each piece would; with no `why`, none is
    answered, as when every worker died before taking one."""

    procs = [None, None]
    first_job = 0.0
    ready = []
    early = False

    def __init__(self, why: str):
        self.why = why

    def compile(self, jobs, cache, on_stored=None, meanwhile=lambda: None):
        meanwhile()
        return {job.key: self.why for job in jobs} if self.why else {}

    def close(self):
        self.closed = True


def _decompose_and_compile(ctx, gm):
    return inductor.full_inductor_compilation(inductor.inductor_decomposition(gm, ctx), ctx)


@pytest.mark.parametrize("why, first", [("the worker exited (code -9)", "the worker exited (code -9)"), ("", "no worker left")])
def test_pieces_the_workers_fail_on_are_decomposed_and_compiled_by_the_pass(why, first, tmp_path, monkeypatch, caplog):
    compiled = counting_fx_compile(monkeypatch)
    gm, ctx, real = deep_step(8)
    ctx.cfg = parse_args(["--compile.cache_dir", str(tmp_path / "alone")])
    alone = _decompose_and_compile(ctx, gm)
    groups = len(compiled)
    compiled.clear()
    failing = _Failing(why)
    monkeypatch.setattr(compile_workers, "take", lambda: failing)
    gm, ctx, _ = deep_step(8)
    ctx.cfg = parse_args(["--compile.cache_dir", str(tmp_path / "workers")])
    with caplog.at_level(logging.WARNING, logger="graph_trainer"):
        runner = _decompose_and_compile(ctx, gm)
    report = ctx.report["inductor_decomposition"]
    assert (report["worker_compiled_pieces"], report["decomposed_pieces"], len(compiled)) == (0, groups, groups) and groups > 1
    assert failing.closed
    assert [r.getMessage() for r in caplog.records] == [
        f"compile workers: {groups} of {groups} pieces failed, compiled here instead (first: {first})"]
    assert all(torch.equal(a, b) for a, b in zip(alone(*real), runner(*real)))


def test_the_rank_loads_each_piece_a_worker_stored_while_the_workers_compile_the_others(tmp_path, monkeypatch):
    """The rank waits on its workers anyway: it loads each stored piece then, in its own thread, and the full compile
    takes what it loaded instead of reading the entry again; the step computes what it computes alone."""
    gm, ctx, real = deep_step(8)
    ctx.cfg = parse_args(["--compile.cache_dir", str(tmp_path / "alone")])
    alone = _decompose_and_compile(ctx, gm)
    workers = compile_workers.CompileWorkers(1)
    monkeypatch.setattr(compile_workers, "take", lambda: workers)
    compiling, loads = [], []
    compile_in_workers, load = workers.compile, CompileCache.load

    def compile(*args, **kwargs):
        compiling.append(True)
        try:
            return compile_in_workers(*args, **kwargs)
        finally:
            compiling.clear()

    monkeypatch.setattr(workers, "compile", compile)
    monkeypatch.setattr(CompileCache, "load", lambda cache, key: loads.append((key, bool(compiling), threading.get_ident()))
                        or load(cache, key))
    gm, ctx, _ = deep_step(8)
    ctx.cfg = parse_args(["--compile.cache_dir", str(tmp_path / "workers")])
    runner = _decompose_and_compile(ctx, gm)
    stored = entries(tmp_path / "workers")
    assert ctx.report["inductor_decomposition"]["worker_compiled_pieces"] == len(stored) > 1
    assert sorted(f"{key}.bin" for key, _, _ in loads) == sorted(stored)
    assert all(during and thread == threading.get_ident() for _, during, thread in loads)
    assert all(torch.equal(a, b) for a, b in zip(alone(*real), runner(*real)))


def test_the_step_is_priced_while_the_workers_compile_before_any_piece_is_loaded(tmp_path, monkeypatch):
    """prediction.json's estimate of the step is made once every piece has gone out to the workers, before the rank
    takes any answer (so before it loads any stored piece): off the path to the first step. It prices the graph the
    pass was given, once."""
    gm, ctx, _ = deep_step(8)
    ctx.cfg = parse_args(["--compile.cache_dir", str(tmp_path)])
    nodes = [(n.op, n.target, n.args) for n in gm.graph.nodes]
    workers = compile_workers.CompileWorkers(1)
    monkeypatch.setattr(compile_workers, "take", lambda: workers)
    events, compile_in_workers, load = [], workers.compile, CompileCache.load

    def compile(jobs, *args, **kwargs):
        events.append(("compile", len(jobs)))
        return compile_in_workers(jobs, *args, **kwargs)

    def estimate(graph, pctx):
        events.append(("estimate", graph is gm and [(n.op, n.target, n.args) for n in graph.graph.nodes] == nodes,
                       workers.first_job is not None))
        return "estimate"

    monkeypatch.setattr(workers, "compile", compile)
    monkeypatch.setattr(registry, "estimate_graph", estimate)
    monkeypatch.setattr(CompileCache, "load", lambda cache, key: events.append(("load",)) or load(cache, key))
    apply_passes(gm, ["inductor_decomposition", "full_inductor_compilation"], ctx, "train_step")
    stored = len(entries(tmp_path))
    assert stored > 1 and events == [("compile", stored), ("estimate", True, True)] + [("load",)] * stored
    assert registry.ESTIMATES.pop("train_step") == "estimate"


def test_jobs_go_out_heaviest_first_by_what_they_take_to_compile(tmp_path, caplog):
    """One worker compiles the jobs in the order they go out: the embedding's backward (`SLOW_TO_COMPILE`) before a
    piece of 40 adds; then, with no job left, it is stopped."""
    workers = compile_workers.CompileWorkers(1)
    grad, ids = torch.randn(4, 8), torch.randint(0, 16, (4,))
    adds = _job(lambda x: sum((x + i for i in range(40)), x), torch.randn(4))
    embedding = _job(lambda g, i: torch.ops.aten.embedding_dense_backward.default(g, i, 16, -1, False), grad, ids)
    embedding.key = "e" + embedding.key[1:]
    try:
        with caplog.at_level(logging.INFO, logger="graph_trainer"):
            outcomes = workers.compile([adds, embedding], CompileCache(tmp_path))
        # stopped as soon as no job was left for it, before `close`
        assert workers.procs[0].wait(30) is not None
    finally:
        workers.close()
    assert outcomes == {adds.key: "", embedding.key: ""}
    # each named by its largest input, in the order compiled
    done = [r.getMessage().split(") in ")[0] for r in caplog.records if r.getMessage().startswith("compile workers: piece")]
    assert done == [f"compile workers: piece of {len(job.piece.graph.nodes)} nodes (largest input {largest}"
                    for job, largest in ((embedding, "float32[4, 8]"), (adds, "float32[4]"))]
    assert len(embedding.piece.graph.nodes) < len(adds.piece.graph.nodes)


def test_stopping_workers_kills_every_one_before_waiting_for_any():
    """Each exit tears down a CUDA context: waited for one after the other, 8 workers kept the first step waiting."""
    from graph_trainer import worker_processes

    processes = worker_processes.spawn(2, "cpu")
    calls = []
    for i, proc in enumerate(processes.procs):
        kill, wait = proc.kill, proc.wait
        proc.kill = lambda i=i, kill=kill: calls.append(f"kill {i}") or kill()
        proc.wait = lambda *a, i=i, wait=wait, **k: calls.append(f"wait {i}") or wait(*a, **k)
    processes.stop()
    assert calls == ["kill 0", "kill 1", "wait 0", "wait 1"]
    assert all(proc.poll() is not None for proc in processes.procs) and not processes.folder.exists()


def test_the_warm_up_compiles_a_graph_on_the_workers_device(monkeypatch):
    """A worker's first compile happens while the rank traces (compile_worker_process._warm_up); a warm-up that
    raised would leave every first piece to pay for it, with only a line in the worker's log to say so."""
    from graph_trainer.passes import compile_worker_process

    made = []
    real = compile_worker_process.compile_graph
    monkeypatch.setattr(compile_worker_process, "compile_graph", lambda *a: made.append(real(*a)) or made[-1])
    compile_worker_process._warm_up(torch.device("cpu"))
    assert len(made) == 1 and made[0] is not None


def test_workers_start_early_only_for_a_job_that_will_compile_pieces_and_go_to_the_first_compile(tmp_path):
    """`graph-trainer train` starts the workers before its imports where the traced step will be compiled by pieces
    into a cache that holds no traced step yet; the compile adopts them when they are what it asks for."""
    from graph_trainer import worker_processes

    def job(*flags):
        return parse_args(["--job.dump_folder", str(tmp_path), "--compile.compile_workers", "1",
                           "--compile.inductor_compilation", "full", *flags])

    try:
        for flags in (["--compile.mode", "eager"], ["--compile.inductor_compilation", "regional"], ["--compile.cache_dir", "off"],
                      ["--compile.no-block_reuse"], ["--compile.compile_workers", "0"]):
            worker_processes.start_early(job(*flags))
            assert worker_processes._early is None, flags
        worker_processes.start_early(job())
        early = worker_processes._early
        assert early is not None and len(early.procs) == 1 and early.device == "cpu"
        # asked for two: these are stopped, the compile starts its own
        assert worker_processes.adopt(2, "cpu") is None and early.procs[0].wait(30) is not None
        worker_processes.start_early(job())
        again = worker_processes._early
        adopted = worker_processes.adopt(1, "cpu")
        assert adopted is again and worker_processes.adopt(1, "cpu") is None
        adopted.stop()
        assert adopted.procs[0].poll() is not None and not adopted.folder.exists()
    finally:
        worker_processes.stop_early()
    # a stored trace: a restart, which loads its compiled pieces
    (tmp_path / "compile_cache" / "traces").mkdir(parents=True)
    (tmp_path / "compile_cache" / "traces" / ("0" * 64 + ".bin")).write_bytes(b"")
    worker_processes.start_early(job())
    assert worker_processes._early is None


@pytest.mark.parametrize("cores, ranks, expected", [(16, 1, 8), (32, 2, 4), (64, 4, 4), (32, 8, 1), (12, 4, 0)])
def test_auto_gives_a_rank_workers_by_its_share_of_the_nodes_cores(cores, ranks, expected, monkeypatch):
    # alone on its node, one per THREADS cores; beside other ranks, half as many of its share (measured on 2 H200s)
    from graph_trainer import worker_processes

    monkeypatch.setattr(worker_processes.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    assert worker_processes.worker_count(worker_processes.AUTO, "cuda") == expected
    assert worker_processes.worker_count(worker_processes.AUTO, "cpu") == 0
    assert worker_processes.worker_count(3, "cuda") == 3
