"""Compile workers (graph_trainer/passes/compile_workers.py): the distinct pieces of a block-reused step compiled in
worker processes into the compile cache, loaded by the full compile; what a worker cannot compile the pass compiles."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import fx

from helpers import cached_run, grad_norms, launch, losses, read_metrics
from test_block_compile import counting_fx_compile, deep_step
from test_compile_cache import entries, full_inductor

from graph_trainer.compile_cache import CompileCache
from graph_trainer.config import parse_args
from graph_trainer.passes import compile_workers, inductor


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
    return compile_workers.Job("k" + "0" * 63, {}, gm)


def test_a_piece_a_worker_cannot_compile_and_a_dead_worker_are_reported_not_raised(tmp_path):
    workers = compile_workers.CompileWorkers(1)
    cache = CompileCache(tmp_path)
    try:
        x = torch.randn(4)
        # an op the worker's process does not register: it answers with the error and takes the next job
        outcomes = workers.compile([_job(lambda x: torch.ops.gt_test.unknown_to_workers(x), x)], cache, None)
        assert "unknown_to_workers" in outcomes["k" + "0" * 63]
        workers.procs[0].kill()
        workers.procs[0].wait()
        outcomes = workers.compile([_job(lambda x: x + 1, x)], cache, None)
        assert outcomes["k" + "0" * 63].startswith("the worker exited")
    finally:
        workers.close()
    assert not list(tmp_path.glob("*.bin")) and not workers.folder.exists()


class _Failing:
    """Workers whose every job fails (`why`), as a worker that crashes on each piece would; with no `why`, none is
    answered, as when every worker died before taking one."""

    procs = [None, None]

    def __init__(self, why: str):
        self.why = why

    def compile(self, jobs, cache, options):
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
