"""The decided step: what the passes and the full compile made of the traced step, stored beside the compile
cache so that a restart runs it without loading the trace or running a pass.

The trace cache (trace_cache.py) spares a restart the trace, but the passes then ran again on the loaded graph: on one
H200 (llama3 8B as one rank of dp_shard 8, `configs/llama3_8b.toml`) loading the 13,482-node step took 3.3 s and the
passes 3.5 s of a 21.1 s restart (bench/results/2026-11-30-session28, call 6). What a step compiled by pieces
(passes/block_compile.py) runs is small: each piece's slots and group; each group's compile-cache entry, or its
module where it runs as FX (a few communication pieces); the constants; where the outputs are. That is the entry,
`<compile cache>/steps/<key>.bin` (the compile cache's format: whole or absent, checksummed), with the passes'
figures for the step-1 record and the cost model's estimate for prediction.json.

The key is the trace's (trace_cache.py: code, torch, configuration, placements, inputs, device kind, rank where the
ranks' graphs differ) with the communication mode and world size: a plan on the fake process group is priced on a
model of the link (`graph-trainer precompile`), a real job's on its probe of the links. A restart reuses the plan
the first start made from its probe; it does not plan again from a new one.

Every rank reads its entry and loads the compiles it names first; then the ranks agree (an all-reduce of one flag):
all of them run the stored step, or all trace (or load the trace) and run the passes, since ranks that plan
differently deadlock. What the passes set up beside the graph is made again before the step runs: the twin
communicators (parallel/links.py, in the order they were made, which their names follow) and symmetric memory for
the groups the async-TP ops name. An entry naming a process group that still does not exist is refused.

Only a train step the full compile ran by pieces is stored (no pass wrapping the compiled step after it, every
compiled group held by the compile cache); any other step starts as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from .. import compile_cache, graph_pickle
from ..checkpoint import any_rank
from ..config import cache_folder
from ..graph_dump import is_collective
from ..parallel.compat import is_fake_process_group
from ..parallel.links import make_twin_sets, twin_sets
from ..passes.bucketing_compat import group_size
from ..passes.block_compile import GroupCall, PieceRunner, Slots, boxed
from ..passes.compat import enable_symmetric_memory
from ..passes.registry import ESTIMATES, Compiled
from ..step_watchdog import group_timeout

logger = logging.getLogger("graph_trainer")

OF_THE_START = ("compile_cache", "compile_workers", "worker_compiled_pieces", "decomposed_pieces")
"""Figures of the passes that describe the start that decided the step, not the step: left out of the entry, as are
the timings (names ending in `_s`)."""


def _group_names(gm: fx.GraphModule) -> tuple[list[str], list[str]]:
    """The process groups the step's collectives name, and those its symmetric-memory ops name."""
    named: set[str] = set()
    symmetric: set[str] = set()
    for node in gm.graph.nodes:
        symm = getattr(node.target, "namespace", None) == "symm_mem"
        if node.op != "call_function" or not (symm or is_collective(node)):
            continue
        for arg in (*node.args, *node.kwargs.values()):
            if isinstance(arg, str) and group_size(arg) is not None:
                named.add(arg)
                if symm:
                    symmetric.add(arg)
    return sorted(named), sorted(symmetric)


def _bare(module: fx.GraphModule) -> bytes:
    """A group run as FX, pickled without its nodes' metadata: running it needs only its code (a communication
    piece of 6-layer debugmodel pickled to 160-220 kB with its fake values and stack traces)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    for node in graph.nodes:
        node.meta = {}
    return graph_pickle.dumps(fx.GraphModule(module, graph))


def _agree(usable: bool, device: torch.device) -> bool:
    """Whether every rank of the job has a usable entry."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or is_fake_process_group():
        return usable
    return not any_rank(not usable, device)


@dataclasses.dataclass
class StepCache:
    """One step's entry: `load` it (every rank together), or `store` the compiled step; `outcome` is hit, miss or
    refused (why)."""

    steps: compile_cache.CompileCache
    pieces: compile_cache.CompileCache
    key: str
    parts: dict
    outcome: str = "miss"

    @classmethod
    def of(cls, cfg: Any, trace_key: str) -> StepCache:
        folder = cache_folder(cfg)
        parts = {"trace": trace_key, "comm": cfg.comm.mode, "world": dist.get_world_size() if dist.is_initialized() else 1}
        key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
        return cls(compile_cache.CompileCache(folder / "steps"), compile_cache.CompileCache(folder), key, parts)

    def _read(self) -> tuple[dict, list[GroupCall]] | None:
        """The entry and its groups' calls, or None where there is no usable one (refused: one warning)."""
        try:
            payload = self.steps.read(self.key)
            if payload is None:
                return None
            entry = pickle.loads(payload)
            groups = []
            for key, module in entry["groups"]:
                if key is not None:
                    artifact = self.pieces.load(key)
                    if artifact is None:
                        raise compile_cache.Refused(f"the compile cache lacks its piece {key[:16]}")
                    groups.append(GroupCall(boxed(Compiled(artifact, None)), key=key))
                else:
                    loaded = graph_pickle.loads(module)
                    groups.append(GroupCall(boxed(Compiled(loaded, loaded)), module=loaded))
            return entry, groups
        except Exception as e:  # noqa: BLE001  (an entry that cannot be used means: start as a cold start does)
            why = str(e) if isinstance(e, compile_cache.Refused) else compile_cache.first_line(e)
            logger.warning(f"step cache: entry {self.steps.path(self.key)} refused ({why}); tracing the step")
            self.outcome = f"refused ({why})"
            return None

    def load(self, ctx: Any) -> tuple[Compiled, dict] | None:
        """The stored step and the step-1 figures it was stored with, where every rank has a usable entry."""
        found = self._read()
        if not _agree(found is not None, ctx.device):
            if found is not None:
                self.outcome = "refused (another rank has no usable entry)"
            return None
        entry, groups = found
        make_twin_sets(entry["twins"], ctx.meshes, group_timeout(ctx.cfg.comm.timeout_seconds))
        for name in entry["symmetric_memory"]:
            enable_symmetric_memory(name)
        missing = [name for name in entry["named"] if group_size(name) is None]
        if missing:
            self.outcome = f"refused (process group {missing[0]} does not exist)"
            logger.warning(f"step cache: entry {self.steps.path(self.key)} {self.outcome}; tracing the step")
            return None
        if entry["estimate"] is not None:
            ESTIMATES["train_step"] = entry["estimate"]
        self.outcome = "hit"
        runner = PieceRunner([Slots(*s) for s in entry["slots_of"]], entry["order"], groups, entry["constants"],
                             entry["result"], entry["slots"])
        loaded = sum(g.key is not None for g in groups)
        figures = {**entry["figures"], "compile_cache": "hit", "compile_cache_entries_loaded": loaded,
                   "compile_cache_entries_written": 0}
        return Compiled(runner, None), figures

    def store(self, compiled: Any, report: dict[str, dict[str, Any]]) -> None:
        """Store the compiled step, where it is one the full compile ran by pieces (else nothing is stored)."""
        runner = compiled.fn if isinstance(compiled, Compiled) and not compiled.boxed else None
        if (not isinstance(runner, PieceRunner) or compiled.graph_module is None
                or any(g.key is None and g.module is None for g in runner.groups)):
            return
        start = time.perf_counter()
        named, symmetric = _group_names(compiled.graph_module)
        figures = {k: v for figures in report.values() for k, v in figures.items()
                   if not k.endswith("_s") and not k.startswith(OF_THE_START)}
        try:
            entry = {
                "slots_of": [(s.inputs, s.outputs, s.frees, s.releases) for s in runner.slots_of],
                "order": runner.order,
                "groups": [(g.key, None if g.key is not None else _bare(g.module)) for g in runner.groups],
                "constants": runner.constants,
                "result": runner.result,
                "slots": runner.slots,
                "twins": twin_sets(),
                "named": named,
                "symmetric_memory": symmetric,
                "estimate": ESTIMATES.get("train_step"),
                "figures": figures,
            }
            self.steps.write(self.key, pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL), self.parts)
        except Exception as e:  # noqa: BLE001  (a step that cannot be stored still runs)
            logger.warning(f"step cache: cannot store the compiled step in {self.steps.folder} ({compile_cache.first_line(e)}); "
                           "the next start runs the passes again")
            return
        logger.info(f"step cache: stored in {time.perf_counter() - start:.1f} s, entry {self.steps.path(self.key)}")

