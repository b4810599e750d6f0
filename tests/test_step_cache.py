"""The decided step (graph_trainer/capture/step_cache.py): what the passes and the full compile made of the traced step,
stored so that a restart runs it without the trace or a pass.

Here: the entry of a step compiled by pieces loads as a runner that computes what the stored one did; an entry naming a
process group this start has not made is refused; a step the full compile did not run by pieces is not stored; the
ranks run the stored step only where every rank has its entry. The end-to-end restarts (one process and 2 gloo ranks
with the overlap schedule, bitwise the cold start's losses and grad norms; a truncated entry) are in
test_compile_cache.py.
"""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import fx

from helpers import launch

from graph_trainer.capture.step_cache import StepCache
from graph_trainer.passes.block_compile import GroupCall, PieceRunner, Slots, boxed, _Slot
from graph_trainer.passes.registry import Compiled


@pytest.fixture(scope="module")
def fake_pg():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _cache(tmp_path) -> StepCache:
    cfg = SimpleNamespace(compile=SimpleNamespace(cache_dir=str(tmp_path)), job=SimpleNamespace(dump_folder=""),
                          comm=SimpleNamespace(mode="real", timeout_seconds=60))
    return StepCache.of(cfg, "0" * 64)


def _ctx() -> SimpleNamespace:
    return SimpleNamespace(device=torch.device("cpu"), meshes=None, cfg=SimpleNamespace(comm=SimpleNamespace(timeout_seconds=60)))


def _double_then_add(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
    return (x * 2 + y,)


def _runner(group_name: str) -> Compiled:
    """A step of two pieces of one group run as FX: slot 2 = 2 * x + y, then slot 3 = 2 * slot 2 + y, whose graph holds
    one all-reduce over `group_name` (the collectives the entry records the groups of)."""
    module = fx.symbolic_trace(_double_then_add)
    step = fx.Graph()
    x, y = step.placeholder("x"), step.placeholder("y")
    reduced = step.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", group_name))
    step.output((reduced,))
    group = GroupCall(boxed(Compiled(module, module)), module=module)
    runner = PieceRunner([Slots([0, 1], [2], [0], []), Slots([2, 1], [3], [2, 1], [])], [0, 0], [group], [], (_Slot(3),), 4)
    return Compiled(runner, fx.GraphModule(torch.nn.Module(), step))


def test_a_stored_step_loads_as_a_runner_that_computes_the_same(fake_pg, tmp_path):
    world = dist.group.WORLD.group_name
    compiled = _runner(world)
    x, y = torch.randn(3), torch.randn(3)
    expected = compiled(x, y)
    _cache(tmp_path).store(compiled, {"some_pass": {"buckets": 3, "pass_some_pass_s": 0.5, "compile_cache": "miss"}})
    entry = _cache(tmp_path)
    loaded = entry.load(_ctx())
    assert entry.outcome == "hit"
    step, figures = loaded
    assert torch.equal(step(x, y)[0], expected[0]) and torch.equal(expected[0], (x * 2 + y) * 2 + y)
    # the step's figures come back; the start's timings and cache counts do not (the load reports its own)
    assert figures == {"buckets": 3, "compile_cache": "hit", "compile_cache_entries_loaded": 0, "compile_cache_entries_written": 0}


def test_an_entry_naming_a_process_group_this_start_lacks_is_refused(fake_pg, tmp_path):
    world = dist.group.WORLD.group_name
    _cache(tmp_path).store(_runner(world), {})
    path = next((tmp_path / "steps").glob("*.bin"))
    # the same entry, its collective on a group no start has made: as a twin communicator the passes made is, before
    # a start that does not make it again
    import pickle

    from graph_trainer.compile_cache import CompileCache

    store = CompileCache(tmp_path / "steps")
    entry = pickle.loads(store.read(path.stem))
    store.write(path.stem, pickle.dumps({**entry, "named": [world, "no_such_group"]}), {})
    cache = _cache(tmp_path)
    assert cache.load(_ctx()) is None
    assert cache.outcome == "refused (process group no_such_group does not exist)"


def test_only_a_step_run_by_pieces_is_stored(fake_pg, tmp_path):
    module = fx.symbolic_trace(_double_then_add)
    _cache(tmp_path).store(Compiled(module, module), {})
    # a piece whose compile no cache entry holds cannot be made again
    runner = _runner(dist.group.WORLD.group_name)
    runner.fn.groups[0] = GroupCall(runner.fn.groups[0].call)
    _cache(tmp_path).store(runner, {})
    assert not (tmp_path / "steps").exists()
    assert _cache(tmp_path).load(_ctx()) is None


def test_the_ranks_run_the_stored_step_only_where_every_rank_has_its_entry(tmp_path):
    script = tmp_path / "agree.py"
    script.write_text(textwrap.dedent("""
        import torch
        import torch.distributed as dist
        from graph_trainer.capture.step_cache import _agree

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        print(f"rank {rank}: one lacks it {_agree(rank == 0, torch.device('cpu'))}, all have it {_agree(True, torch.device('cpu'))}")
        dist.destroy_process_group()
    """))
    proc = launch([], nproc=2, script=str(script))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the ranks' lines may interleave in the one stdout
    for rank in (0, 1):
        assert f"rank {rank}: one lacks it False, all have it True" in proc.stdout
