"""The job's communicators beyond the mesh's own, and what its links measure.

- `gather_twins`: a second communicator for every mesh dimension, over the same ranks. NCCL runs one
  communicator's collectives one after another on its stream; the FSDP all-gathers on the twin run
  beside the reduce-scatters (passes/gather_group.py). `all_to_all_twins`: a third one, for the expert
  all-to-alls of passes/ep_overlap.py.
- `probe`: the bandwidth and latency of each mesh dimension's link, timed once at start-up with
  all-gathers of two sizes (the median call of each, on the device: the calls queue behind a sleep) and fitted to the ring model the cost model
  prices collectives with (hardware.ring_collective_s: `steps * latency + (ranks - 1) / ranks *
  bytes / bandwidth`); on the expert-parallel dimension also all-to-alls, fitted the same way. NCCL
  runs an all-to-all as point-to-point sends, and copies the rank's own share in the same kernel. Every
  rank takes the slowest rank's times (an all-reduce of the timings), so every rank derives the same
  schedule from the same graph: ranks that planned differently would deadlock.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("graph_trainer")


@dataclass(frozen=True)
class Measured:
    bytes_per_s: float
    latency_s: float
    """Seconds per ring step."""


_TWINS: dict[str, str] = {}
_A2A_TWINS: dict[str, str] = {}
_MEASURED: dict[str, Measured] = {}
_MEASURED_ALL_TO_ALL: dict[str, Measured] = {}
_WORLD: dict[str, object] = {}
"""The default group the twins and measurements belong to: a new process group (a test's second
job, a re-initialised fake group) starts afresh."""


def _current(key: str, table: dict) -> dict:
    world = dist.group.WORLD
    if _WORLD.get(key) is not world:
        table.clear()
        _WORLD[key] = world
    return table


def mesh_dims(meshes) -> list[tuple[str, list[list[int]]]]:
    """(this rank's group name, every group of that dimension as rank lists), for each mesh dimension
    of more than one rank; the same dimension order on every rank."""
    out: list[tuple[str, list[list[int]]]] = []
    seen: set[str] = set()
    for mesh in (meshes.dense, getattr(meshes, "sparse", None)):
        if mesh is None:
            continue
        for dim in range(mesh.ndim):
            size = mesh.mesh.shape[dim]
            name = mesh.get_group(dim).group_name
            if size == 1 or name in seen:
                continue
            seen.add(name)
            out.append((name, mesh.mesh.movedim(dim, -1).reshape(-1, size).tolist()))
    return out


_MADE: dict[str, None] = {}
"""The twin sets made in this process group, in the order made: the names of new groups follow from it."""


def _make_twins(key: str, table: dict[str, str], meshes, timeout: timedelta) -> dict[str, str]:
    twins = _current(key, table)
    if twins:
        return twins
    _current("made", _MADE)[key] = None
    for name, groups in mesh_dims(meshes):
        # every rank makes every group of the dimension, in the same order: no rank waits on another's choice
        mine, _ = dist.new_subgroups_by_enumeration(groups, timeout=timeout)
        twins[name] = mine.group_name
    return twins


def gather_twins(meshes, timeout: timedelta) -> dict[str, str]:
    """Group name -> the name of its twin communicator (same ranks), made once per process group.
    `timeout`: the job's collective timeout (--comm.timeout_seconds); a new group's default (gloo 30
    minutes, NCCL 10) would keep a rank waiting on a dead peer that long."""
    return _make_twins("twins", _TWINS, meshes, timeout)


def all_to_all_twins(meshes, timeout: timedelta) -> dict[str, str]:
    """Group name -> a third communicator over the same ranks for the expert all-to-alls
    (passes/ep_overlap.py): apart from the reduce-scatters and from the all-gathers' twin."""
    return _make_twins("all_to_all_twins", _A2A_TWINS, meshes, timeout)


def made_twins() -> list[tuple[str, str]]:
    """(mesh group, twin) of every twin made so far in this process group (none are made here)."""
    return [*_current("twins", _TWINS).items(), *_current("all_to_all_twins", _A2A_TWINS).items()]


def twin_sets() -> list[str]:
    """The twin sets made so far in this process group ("twins", "all_to_all_twins"), in the order they were made."""
    return list(_current("made", _MADE))


def make_twin_sets(kinds: list[str], meshes, timeout: timedelta) -> None:
    """Make the twin sets `kinds` in that order, as the passes of an earlier start made them (capture/step_cache.py):
    made in the same order, their groups get the same names."""
    makers = {"twins": gather_twins, "all_to_all_twins": all_to_all_twins}
    for kind in kinds:
        makers[kind](meshes, timeout)


def twin_of(group_name: str) -> str | None:
    """The mesh group a twin communicator stands in for (None for a mesh group or an unknown name)."""
    return next((k for k, v in made_twins() if v == group_name), None)


PROBE_BYTES = (1 << 20, 64 << 20)
"""Sizes timed (gathered, or each rank's all-to-all buffer): the small one is latency-bound, the large one
bandwidth-bound on NVLink."""
PROBE_REPEATS = (50, 10)
"""Calls timed per size, back to back, each on its own: the median call is the link's, not a rank that
arrived late at one of them (the 8B runs of 2026-11-27 measured 159-348 GB/s on the same NVLink when
the calls were timed as one span)."""
HOLD_CYCLES = 50_000_000
"""GPU clock cycles the stream sleeps before each size's timed calls (25-35 ms at H100/H200 clocks), so that
the host has queued all of them before the first runs: timed as the host issued them, each small call took
the host's ~70 us to issue (two H200s: 68.6-69.2 us "per ring step"), and the fit through that point made
the link faster than it is (368 GB/s for all-gathers, 475 for all-to-alls, where the step's 402 MB
all-to-alls ran at 250-300 GB/s)."""


def _time(kind: str, group, ranks: int, nbytes: int, repeats: int, device: torch.device) -> float:
    """The median of `repeats` collectives' times on this rank's stream: all-gathers whose gathered output is
    `nbytes`, or all-to-alls of `nbytes` a rank (the unsharded size, as the cost model prices both)."""
    if kind == "all_gather":
        src = torch.empty(nbytes // ranks // 2, dtype=torch.bfloat16, device=device)
        out = torch.empty(src.numel() * ranks, dtype=src.dtype, device=device)

        def call() -> None:
            dist.all_gather_into_tensor(out, src, group=group)
    else:
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(src)

        def call() -> None:
            dist.all_to_all_single(out, src, group=group)
    for _ in range(3):
        call()
    dist.barrier(group=group)
    torch.cuda.synchronize(device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
    torch.cuda._sleep(HOLD_CYCLES)
    events[0].record()
    for event in events[1:]:
        call()
        event.record()
    torch.cuda.synchronize(device)
    return statistics.median(a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:]))


def fit(ranks: int, small_s: float, large_s: float) -> Measured:
    """Bandwidth and latency per ring step from the times of the two probe sizes (hardware.ring_collective_s's
    model of an all-gather and of an all-to-all: `steps * latency + (ranks - 1) / ranks * bytes / bandwidth`)."""
    small, large = PROBE_BYTES
    share = (ranks - 1) / ranks
    bandwidth = share * (large - small) / max(large_s - small_s, 1e-9)
    return Measured(bandwidth, max(small_s - share * small / bandwidth, 0.0) / (ranks - 1))


def probe(meshes, device: torch.device) -> dict[str, Measured]:
    """Time every mesh dimension's link once (a few milliseconds on NVLink) and keep the fit. GPUs
    only: a fake process group moves nothing, and the CPU test machines' gloo loopback is what
    hardware.CPU_GLOO describes."""
    measured = _measured("all_gather")
    if measured or device.type != "cuda" or not dist.is_initialized() or dist.get_backend() == "fake":
        return measured
    dims = mesh_dims(meshes)
    if not dims:
        return measured
    from torch.distributed.distributed_c10d import _resolve_process_group

    expert = meshes.ep.get_group().group_name if meshes.degrees.ep > 1 else None
    probes = [("all_gather", name, groups) for name, groups in dims]
    probes += [("all_to_all", name, groups) for name, groups in dims if name == expert]
    times = torch.tensor([[_time(kind, _resolve_process_group(name), len(groups[0]), n, k, device)
                           for n, k in zip(PROBE_BYTES, PROBE_REPEATS)] for kind, name, groups in probes],
                         dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    for (kind, name, groups), (t_small, t_large) in zip(probes, times.tolist()):
        _measured(kind)[name] = found = fit(len(groups[0]), t_small, t_large)
        logger.info(f"link of {len(groups[0])} ranks ({name}, {kind.replace('_', '-')}): {found.bytes_per_s / 1e9:.0f} GB/s, "
                    f"{found.latency_s * 1e6:.1f} us per ring step (measured)")
    return measured


def measured_link(group_name: str, kind: str = "all_gather") -> Measured | None:
    """The probe's figures for a mesh group or its twin (None where nothing was measured): its all-gathers', or its
    all-to-alls' (`kind` "all_to_all", the expert-parallel dimension only)."""
    measured = _measured(kind)
    return measured.get(group_name) or measured.get(twin_of(group_name) or "")


def _measured(kind: str) -> dict[str, Measured]:
    """The probe's fits of this process group by mesh group: of its all-to-alls, or of its all-gathers (any other kind)."""
    if kind == "all_to_all":
        return _current("measured_all_to_all", _MEASURED_ALL_TO_ALL)
    return _current("measured", _MEASURED)
