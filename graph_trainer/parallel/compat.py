"""torch's fake process group (a private testing module) and what callers ask of it.

On the fake process group one process stands in for one rank of a larger job: meshes, shards and
collective shapes are those of that rank, but collectives move no data, so what they return is
uninitialised memory. `graph-trainer train --comm.mode fake`, `graph-trainer plan` and fake-mesh
traces all build on it.

Also the names process groups are registered under (`group_ranks`, `fake_groups_named`), the private Tensor
attribute eager resharding (simple_fsdp.reshard_after_forward) finds views with,
and the functional collectives eager SimpleFSDP gathers with (renamed in torch 2.13), whether
autograd's engine is running a backward pass, and gloo as CPU jobs run it (`serial_gloo`).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """Make this process rank `rank` of `world_size` ranks on the fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch.distributed.tensor import debug

    if dist.is_initialized():
        dist.destroy_process_group()
    # A mesh of an earlier group in this process compares equal to this group's mesh of the same shape
    # and names (DeviceMesh equality ignores the rank), so DTensor's sharding caches (Python's and the
    # C++ fast path's) would hand back output specs on the old mesh, whose coordinates are another rank's.
    debug._clear_sharding_prop_cache()
    debug._clear_fast_path_sharding_prop_cache()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


SERIAL_GLOO = "gloo_serial"


def _make_serial_gloo(store, rank: int, size: int, timeout) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    options._threads = 1
    return dist.ProcessGroupGloo(store, rank, size, options)


def serial_gloo() -> str:
    """The backend CPU jobs initialise: gloo with one worker thread per process group (torch's default is two),
    registered under `SERIAL_GLOO` on first use; every group made later (mesh dims, twins) gets it too.
    On two threads, two all-gathers of one group run at once, and torch 2.13's gloo then corrupts the heap
    (`malloc(): unaligned tcache chunk detected` or a segfault in a `pt_gloo_runloop` thread, under
    `AsyncAllgatherCoalescedWork`): 2 ranks keeping three functional all-gathers in flight crashed in each of
    4 runs of 600 iterations on two threads, in none of 2 on one; the overlap schedule keeps up to four in
    flight, and the traced dp_shard 2 step crashed twice in about 1,000 steps on a 2-core machine and once in
    CI. One thread runs a group's collectives in the order they were issued, as a NCCL communicator's stream
    does (a 2-rank and a 4-rank test took the same time on one thread as on two)."""
    if SERIAL_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(SERIAL_GLOO, _make_serial_gloo, devices=["cpu"])
    return SERIAL_GLOO


def group_ranks(group_name: str) -> list[int]:
    """The global ranks of the process group this process registered under `group_name` (the name a traced
    collective calls it by)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_process_group_ranks(_resolve_process_group(group_name))


def fake_groups_named(world_size: int, rank: int, groups: dict[str, list[int]]) -> None:
    """Make this process rank `rank` of `world_size` on the fake process group, with a group of the given global
    ranks registered under each name: the groups another process's graph names its collectives by, which
    Inductor resolves while it compiles the graph (torch 2.13 reads each group's size and rank for the
    graph's repro script)."""
    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

    init_fake_process_group(world_size, rank)
    for name, ranks in groups.items():
        group = dist.new_group(ranks)
        _unregister_process_group(name)
        _register_process_group(name, group)


def is_fake_process_group() -> bool:
    return dist.is_initialized() and dist.get_backend() == "fake"


def is_lead_process() -> bool:
    """Whether this process writes the run's files and solves its plan: rank 0 of a real job, or the
    one process of a fake one (whichever rank it simulates)."""
    return not dist.is_initialized() or dist.get_rank() == 0 or is_fake_process_group()


def receiving_ranks() -> int:
    """How many ranks `from_lead` sends the lead's value to: the other ranks of a real job (a fake one's one
    process is its own lead)."""
    return dist.get_world_size() - 1 if dist.is_initialized() and not is_fake_process_group() else 0


def from_lead(compute: Callable[[], T]) -> T:
    """`compute()` on the lead process (`is_lead_process`), its value sent to the `receiving_ranks`: what every
    rank must agree on (a plan) is decided once."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    box: list[Any] = [compute() if is_lead_process() else None]
    if receiving_ranks():
        # a caller may be inside a fake mode (Meta's placer session): the broadcast's byte tensors must be real
        with unset_fake_temporarily():
            dist.broadcast_object_list(box, src=0)
    return box[0]


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is a view of (`Tensor._base`), or None."""
    return t._base


def all_gather_single(tensor: torch.Tensor, gather_dim: int, group: tuple) -> torch.Tensor:
    """Functional all-gather along `gather_dim`, waited: `all_gather_single` on torch 2.13 (where the
    older `all_gather_tensor` is deprecated), `all_gather_tensor` on 2.11."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return _waited(gather(tensor, gather_dim=gather_dim, group=group))


def reduce_scatter_single(tensor: torch.Tensor, reduce_op: str, scatter_dim: int, group: tuple) -> torch.Tensor:
    """Functional reduce-scatter along `scatter_dim`, waited (`reduce_scatter_single` on torch 2.13,
    `reduce_scatter_tensor` on 2.11)."""
    import torch.distributed._functional_collectives as funcol

    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return _waited(scatter(tensor, reduce_op, scatter_dim=scatter_dim, group=group))


def all_reduce_single(tensor: torch.Tensor, reduce_op: str, group: tuple) -> torch.Tensor:
    """Functional all-reduce, waited."""
    import torch.distributed._functional_collectives as funcol

    return _waited(funcol.all_reduce(tensor, reduce_op, group=group))


def _waited(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def in_backward() -> bool:
    """Whether this code runs inside a backward pass of autograd's engine (e.g. a checkpointed block's recomputation)."""
    return torch._C._current_graph_task_id() != -1


def declared_stage_shapes(schedule) -> None:
    """Run `schedule`'s stages on the input and output shapes they were built with. torch 2.13's schedule first
    votes over P2P whether every stage declared them, and infers them over P2P where one did not; on the fake
    process group the vote receives a 0 and the inference reads a garbage size, so a fake pipeline rank sets the
    outcome (every stage here declares its shapes). Torch without the vote (2.11) uses the declared shapes."""
    if not hasattr(schedule, "_warmup_p2p"):
        return
    from torch.distributed.pipelining.stage import InferenceMode

    def warmup(stages, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warmup
