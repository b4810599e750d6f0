"""The traced train step stored beside the compile cache, so that a restart does not trace again.

A warm start of llama3 8B (one rank of dp_shard 8, one H100, torch 2.11) spent 9.3 of its 15.1 s to the
first step tracing: make_fx runs the model's Python op by op on fake tensors, every start, although the
compile cache then loads every compiled piece. The graph as traced (before any pass: the passes run again,
since some plan from figures measured at start-up) is stored with torch's `GraphPickler` reductions, which keep
each node's fake value and metadata (the region and block marks the passes read), under
`<compile cache>/traces/<key>.bin` in the compile cache's entry format (whole or absent, checksummed).

The key is everything the trace depends on:
- the code that runs while tracing: graph_trainer's and torchtitan's Python sources (a hash of every file),
  torch's version and source hash;
- the job's configuration, less what cannot reach the graph (`IGNORED`: the run's length, where it writes,
  checkpoints, metrics, profiling);
- the parameters' placements (mesh, placements, global shape and stride), the shape, stride, dtype and
  device of every input, and the device kind (attention's kernel is chosen by the GPU while tracing);
- the number of ranks, and the rank where ranks' graphs differ (a mesh split along two or more dimensions:
  each rank's collectives name their own process groups).
A key that differs is a miss and a fresh trace; an entry that is truncated, corrupt or that torch cannot
unpickle is one warning line and a fresh trace.

A miss stores the trace from a child process forked right after the trace (`store_aside`): pickling the step's
fake values took 2.7-3.6 s of llama3 8B's cold first step (one H100/H200), time the rank now spends on its passes
and compile instead. The child's memory is the rank's at the fork, so it pickles the graph as traced while the
passes change the rank's own; it pickles and writes a file, no more (no CUDA, no collective).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import fx

from .. import compile_cache, graph_pickle
from ..config import CACHED_BACKENDS, cache_folder
from ..parallel.mesh import Degrees
from ..passes.registry import register_teardown
from ..train_step import ParamSpec

logger = logging.getLogger("graph_trainer")

IGNORED = {
    "job": None, "checkpoint": None, "metrics": None, "profiling": None,
    "training": ("steps",), "compile": ("cache_dir", "dump_graphs", "list_passes", "compile_workers"),
    "comm": ("timeout_seconds", "mode", "fake_world_size", "fake_rank"),
}
"""Configuration a restart may change that cannot change the traced graph (None: the whole section). The fake process
group traces the graph the real one does (`graph-trainer precompile` relies on it for the compile cache, whose keys
are the graphs): a precompiled trace serves the job."""


STORE_TIMEOUT_S = 600
"""Longest a forked store may take (70B's took 10.2 s in the rank itself); the run's end waits for it as long."""


@functools.cache
def _sources_hash(package: str) -> str:
    root = Path(importlib.import_module(package).__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _config(cfg: Any) -> dict:
    parts = dataclasses.asdict(cfg)
    for section, keys in IGNORED.items():
        if keys is None:
            parts.pop(section, None)
        else:
            for key in keys:
                parts.get(section, {}).pop(key, None)
    return parts


def _placement(spec: ParamSpec) -> list:
    mesh = spec.mesh
    return [spec.fqn, mesh.mesh.tolist(), list(mesh.mesh_dim_names or ()), [repr(p) for p in spec.placements],
            list(spec.shape), list(spec.stride)]


def _rank(degrees: Degrees) -> list[int]:
    """The rank and world size, where the ranks' graphs differ: on a mesh split along two or more dimensions each
    rank's collectives name process groups of its own; along one, every rank traces the same graph (its shard's
    shape, which uneven sharding may change, is among the inputs), so one entry serves them all, as precompile's
    rank 0 stands for every rank in the compile cache."""
    split = [d for d in (degrees.dp_replicate, degrees.dp_shard, degrees.tp, degrees.ep) if d > 1]
    world = dist.get_world_size() if dist.is_initialized() else 1
    return [dist.get_rank() if dist.is_initialized() and len(split) > 1 else 0, world]


def trace_key(cfg: Any, specs: Sequence[ParamSpec], inputs: Sequence[torch.Tensor], device: torch.device,
              degrees: Degrees) -> tuple[str, dict]:
    """The key of the step's trace with these parameters and inputs, and the parts it hashes."""
    parts = {
        "code": {"graph_trainer": _sources_hash("graph_trainer"), "torchtitan": _sources_hash("torchtitan")},
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "config": _config(cfg),
        "params": [_placement(s) for s in specs],
        "inputs": [compile_cache.value_key(x) for x in inputs],
        "device": compile_cache.device_kind(device),
        "rank": _rank(degrees),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest(), parts


@dataclasses.dataclass
class TraceCache:
    """One step's entry: `load` it, or `store` the step once traced; `outcome` is hit, miss or refused (why)."""

    cache: compile_cache.CompileCache
    key: str
    parts: dict
    outcome: str = "miss"

    @classmethod
    def of(cls, cfg: Any, specs: Sequence[ParamSpec], inputs: Sequence[torch.Tensor], device: torch.device,
           degrees: Degrees) -> TraceCache | None:
        """The entry of this trace in the job's cache; None when the cache is off, or the backend stores no compile
        (then tracing is most of a start's time but a small part of a CPU test's, and storing would add to it)."""
        folder = cache_folder(cfg)
        if folder is None or cfg.compile.inductor_compilation not in CACHED_BACKENDS:
            return None
        return cls(compile_cache.CompileCache(folder / "traces"), *trace_key(cfg, specs, inputs, device, degrees))

    def load(self) -> fx.GraphModule | None:
        try:
            payload = self.cache.read(self.key)
            if payload is None:
                return None
            loaded = graph_pickle.loads(payload)
        except Exception as e:  # noqa: BLE001  (an entry that cannot be used means: trace afresh)
            why = str(e) if isinstance(e, compile_cache.Refused) else f"torch could not unpickle it ({compile_cache.first_line(e)})"
            logger.warning(f"trace cache: entry {self.cache.path(self.key)} refused ({why}); tracing afresh")
            self.outcome = f"refused ({why})"
            return None
        self.outcome = "hit"
        logger.info(f"trace cache: hit, entry {self.cache.path(self.key)}")
        # lazy: the passes recompile the step several times, and an eager module writes its code each time (on llama3
        # 8B, one H100, the passes took 2.7 s on the loaded step, 1.2 s traced)
        return loaded

    def store(self, gm: fx.GraphModule) -> bool:
        try:
            self.cache.write(self.key, graph_pickle.dumps(gm), self.parts)
            return True
        except Exception as e:  # noqa: BLE001  (a trace that cannot be stored still runs)
            logger.warning(f"trace cache: cannot store the traced step in {self.cache.folder} ({compile_cache.first_line(e)}); "
                           "the next start traces it again")
            return False

    def store_aside(self, gm: fx.GraphModule) -> None:
        """`store` the step as it is now from a forked child (see the module docstring), where the platform forks;
        the end of the run (`run_teardowns`) waits for the child."""
        if not hasattr(os, "fork"):
            self.store(gm)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        with warnings.catch_warnings():
            # Python warns at any fork of a process with threads (NCCL's, Inductor's compile pool's): the child only
            # pickles and writes, which takes no lock of theirs
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            stored = False
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(STORE_TIMEOUT_S)
                start = time.perf_counter()
                stored = self.store(gm)
                if stored:
                    logger.info(f"trace cache: stored aside in {time.perf_counter() - start:.1f} s, entry {self.cache.path(self.key)}")
            finally:
                # the parent's exit handlers (compile workers, process groups) are not the child's to run
                os._exit(0 if stored else 1)
        waiter = threading.Thread(target=os.waitpid, args=(pid, 0), daemon=True)
        waiter.start()
        register_teardown(lambda: waiter.join(STORE_TIMEOUT_S))
