"""Compile workers: the distinct pieces of a block-reused train step (passes/block_compile.py) compiled in
parallel processes, each stored in the job's compile cache, from where the full compile then loads them.

Inductor lowers, schedules and writes the code of a graph in Python, one graph at a time; its own pool of
processes builds only the Triton kernels of the graph in hand. The pieces do not depend on one another, so a
cold start spent most of its compile waiting on one core: llama3 8B as one rank of dp_shard 8 (one H200,
torch 2.11) took 23.7 s in the full compile and 3.2 s decomposing, of a 40.3 s first step; with 8 workers
the pieces took 12.8 s, the first step 29.7 s (bench/results/2026-11-28-compile-workers).

The workers are the processes `graph-trainer train` started before its imports (worker_processes.py: a
worker's imports and warm-up took 14-18 s on one H200, longer than the rank's trace), else started before the
step is traced (the backend's `prepare` calls `start`); where it was not traced (its trace was loaded) but two
or more pieces still miss the cache, the pass starts them itself. A job is one piece as bytes
(graph_pickle.py) with only its inputs' values (`_sendable`), its compile-cache key, taken by the pass before
the decomposition (`inductor.PieceEntry`), the piece's Inductor options, the job's Inductor configuration, and the process
groups its collectives name (the worker registers groups of the same ranks under the same names on the fake
process group: Inductor resolves them while it compiles). The worker (compile_worker_process.py) decomposes
the piece, compiles it with the pass's own functions (`inductor.decompose`, `inductor.compile_graph`) and
stores it under that key. Jobs go out heaviest first (`SLOW_TO_COMPILE`) as each is pickled, each to the next
worker free; the rank prices the step (`meanwhile`) and loads each stored piece while the workers compile the
others (`on_stored`), and each worker stops once no job is left for it. A piece a worker fails on is compiled by
the pass itself, as it is without workers, after one warning line.

`--compile.compile_workers N`: N processes per rank. -1 (auto) is `worker_processes.worker_count`: on a GPU rank
alone on its node (one GPU; `graph-trainer precompile`, which fills the cache of a cluster job from one process) one
per `THREADS` cores, on a node of several ranks half as many of the rank's share: each rank compiles every piece (a
compiled piece pins its GPU, so ranks cannot share entries) and traces beside its workers. On CPU none: the pass's own
compile of a small model is quicker than starting a worker. Workers need the compile cache
(`--compile.cache_dir`), where they leave what they compiled. Each opens a CUDA context on the rank's GPU
(Inductor reads the device's properties), closed with the worker before the first step.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import pickle
import queue
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import fx

from .. import compile_cache, graph_pickle, worker_processes
from ..config import cache_folder
from ..parallel.compat import group_ranks
from .compat import FakeTensorMode

logger = logging.getLogger("graph_trainer")

REPLY = "graph-trainer compile worker: "
"""The prefix of a worker's answer on its stdout (anything else a library prints there is skipped)."""


def _sendable(piece: fx.GraphModule) -> fx.GraphModule:
    """A copy of `piece` whose only traced values are its inputs', as fresh tensors of their shapes, strides and dtypes
    (as the compile gets them: `compile_cache.cacheable_inputs`). The worker's decomposition traces the rest again;
    and on torch 2.11 a view a graph pass made (a bucket's split into parameters) does not pickle ("cannot pickle
    'KeyedRef' object"). The subgraphs it reads (FlexAttention's score and mask functions) go with it."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(piece.graph, {}))
    mode = FakeTensorMode()
    for node in graph.nodes:
        val = node.meta.pop("val", None)
        if node.op == "placeholder":
            with mode:
                node.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
    return fx.GraphModule(piece, graph)


SLOW_TO_COMPILE = {torch.ops.aten.embedding_dense_backward.default: 100}
"""Ops that take Inductor far longer than one node's share of a piece, in nodes: the jobs go out heaviest first by
this weight (`_weight`). On one H200 llama3 8B's embedding backward (5 nodes: the op, a view, a cast) compiled in
2.2-2.5 s, as long as a block's forward of 90 nodes; sent last by its node count, the first step waited on it
(bench/results/2026-11-29-session18 and -session19)."""


def _weight(piece: fx.GraphModule) -> int:
    return sum(SLOW_TO_COMPILE.get(node.target, 1) for node in piece.graph.nodes)


def _largest_input(piece: fx.GraphModule) -> str:
    """Its largest input, as the log names a piece (which piece a slow compile was)."""
    vals = [node.meta.get("val") for node in piece.graph.find_nodes(op="placeholder")]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    if not tensors:
        return "no tensor input"
    big = max(tensors, key=lambda t: t.numel())
    return f"largest input {str(big.dtype).removeprefix('torch.')}{list(big.shape)}"


def _group_name(node: fx.Node) -> str | None:
    """The `group_name` argument of a collective's node (None for any other node)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    named = {arg.name: value for arg, value in zip(node.target._schema.arguments, node.args)}
    return {**named, **node.kwargs}.get("group_name")


def _groups(pieces: list[fx.GraphModule]) -> dict | None:
    """This process's world size, rank and the global ranks of each process group the pieces' collectives name."""
    if not dist.is_initialized():
        return None
    names = {_group_name(node) for piece in pieces for node in piece.graph.nodes} - {None}
    return {"world": dist.get_world_size(), "rank": dist.get_rank(), "ranks": {name: group_ranks(name) for name in names}}


@dataclass
class Job:
    key: str
    parts: dict
    piece: fx.GraphModule
    options: dict | None
    """The Inductor options the piece is keyed and compiled with (`inductor._options`)."""


class CompileWorkers:
    """Worker processes that compile pieces into one compile cache folder: the ones `graph-trainer train` started
    early for this rank (worker_processes.py), or new ones."""

    def __init__(self, count: int, device: torch.device = torch.device("cpu")):
        adopted = worker_processes.adopt(count, str(device))
        self.early = adopted is not None
        """Started by `graph-trainer train` before its imports, not here."""
        self.processes = adopted or worker_processes.spawn(count, str(device))
        self.procs, self.logs, self.folder = self.processes.procs, self.processes.logs, self.processes.folder
        self.ready: list[float] = []
        """Each worker's seconds from its start to taking pieces, as its first answer says."""
        self.first_job: float | None = None
        """Seconds from the workers' start to the first piece sent."""
        self.kept = False
        """Lent to several compiles in a row (`lent`): a worker stays once a batch is done, for the next one."""

    def compile(self, jobs: list[Job], cache: compile_cache.CompileCache,
                on_stored: Callable[[str], None] | None = None, meanwhile: Callable[[], None] = lambda: None) -> dict[str, str]:
        """Compile `jobs` into `cache`: for each key, "" where its entry was stored, else why not. The caller waits on
        the workers anyway: `meanwhile()` is called here, in its thread, once every job is out, and `on_stored(key)`
        as each entry is stored, while the workers compile the others. Each worker is stopped as soon as no job is
        left for it, unless the workers are `kept` for a later batch."""
        try:
            groups = _groups([job.piece for job in jobs])
        except Exception as e:  # noqa: BLE001  (workers that cannot name the groups leave every piece to the pass)
            return {job.key: f"cannot name the process groups ({compile_cache.first_line(e)})" for job in jobs}
        shared = {"config": torch._inductor.config.save_config(), "folder": str(cache.folder),
                  "groups": groups}
        todo: queue.Queue[tuple[Job, Path] | None] = queue.Queue()
        answers: queue.Queue[tuple[str, str] | None] = queue.Queue()
        threads = [threading.Thread(target=self._feed, args=(proc, log, todo, answers), daemon=True)
                   for proc, log in zip(self.procs, self.logs)]
        for t in threads:
            t.start()
        outcomes: dict[str, str] = {}
        # each job goes out as soon as it is written, so the heaviest compiles while the others are pickled
        for i, job in enumerate(sorted(jobs, key=lambda j: -_weight(j.piece))):
            path = self.folder / f"job{i}.pkl"
            try:
                payload = {**shared, "graph": graph_pickle.dumps(_sendable(job.piece)), "key": job.key, "parts": job.parts,
                           "options": job.options}
            except Exception as e:  # noqa: BLE001  (a piece that cannot be sent is compiled by the pass)
                outcomes[job.key] = f"cannot send the piece ({compile_cache.first_line(e)})"
                continue
            path.write_bytes(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
            todo.put((job, path))
            if self.first_job is None:
                self.first_job = time.perf_counter() - self.processes.started
        todo.put(None)
        try:
            meanwhile()
        finally:
            # the workers' answers are taken whatever `meanwhile` raised: it leaves no worker behind
            feeding = len(threads)
            while feeding:
                answer = answers.get()
                if answer is None:
                    feeding -= 1
                    continue
                key, outcomes[key] = answer
                if not outcomes[key] and on_stored is not None:
                    on_stored(key)
            for t in threads:
                t.join()
        return outcomes

    def _feed(self, proc: subprocess.Popen, log: Path, todo: queue.Queue, answers: queue.Queue) -> None:
        """Hand `proc` jobs until none is left or it dies; put each job's (key, outcome) on `answers`, then None."""
        ready_told = False
        try:
            while True:
                item = todo.get()
                if item is None:
                    # the end of the jobs, left for the other feeders; this worker is done: its exit (a CUDA
                    # context torn down) overlaps the others' compiles instead of adding to `close`
                    todo.put(None)
                    if not self.kept:
                        proc.kill()
                    return
                job, path = item
                try:
                    proc.stdin.write(f"{path}\n")
                    proc.stdin.flush()
                    line = ""
                    while line is not None and not line.startswith(REPLY):
                        line = proc.stdout.readline() or None
                except OSError:
                    line = None
                if line is None:
                    text = log.read_text().strip().splitlines() if log.exists() else []
                    answers.put((job.key, f"the worker exited ({text[-1] if text else f'code {proc.poll()}'})"))
                    return
                reply = json.loads(line[len(REPLY):])
                if reply.get("ready") is not None and not ready_told:
                    ready_told = True
                    self.ready.append(reply["ready"])
                logger.info(f"compile workers: piece of {len(job.piece.graph.nodes):,} nodes ({_largest_input(job.piece)}) "
                            f"in {reply['seconds']:.1f} s")
                answers.put((job.key, reply["error"]))
        finally:
            answers.put(None)

    def close(self) -> None:
        """Stop the workers: idle (every job answered, each entry renamed into place whole) or still importing."""
        self.processes.stop()


def launch(cfg: Any, device: torch.device) -> CompileWorkers | None:
    """This rank's workers, or None where none are asked for or the compile cache, where they leave their compiles,
    is off."""
    count = worker_processes.worker_count(cfg.compile.compile_workers, device.type)
    if not count or cache_folder(cfg) is None:
        return None
    try:
        return CompileWorkers(count, device)
    except OSError as e:
        logger.warning(f"compile workers: cannot start {count} ({compile_cache.first_line(e)}); the rank compiles every piece itself")
        return None


_started: CompileWorkers | None = None
_lent: CompileWorkers | None = None
"""The workers `lent` holds for the compiles now running."""


def start(pass_names: list[str], cfg: Any, device: torch.device) -> bool:
    """Start this rank's workers now, ahead of the compile that will take them, where the step is compiled by pieces;
    whether the rank has workers."""
    global _started
    if _started is None and "full_inductor_compilation" in pass_names and cfg.compile.block_reuse:
        _started = launch(cfg, device)
        if _started is not None:
            atexit.register(_started.close)
    return _started is not None


def take() -> CompileWorkers | None:
    """The workers lent to this compile (`lent`; `give_back` keeps them), or those `start` started (`give_back` closes
    them), or None."""
    global _started
    if _lent is not None:
        return _lent
    workers, _started = _started, None
    if workers is not None:
        atexit.unregister(workers.close)
    return workers


def give_back(workers: CompileWorkers) -> None:
    """The end of one compile's use of `workers` (from `take` or `launch`): closed, unless lent to several."""
    if workers is not _lent:
        workers.close()


def lending() -> bool:
    """Whether workers are lent to the compiles now running (`lent`)."""
    return _lent is not None


@contextlib.contextmanager
def lent(pass_names: list[str], cfg: Any, device: torch.device) -> Iterator[bool]:
    """One set of workers for several compiles in a row (a pipeline rank's stage graphs, forward and backward of each):
    started now (or adopted from `graph-trainer train`'s early start), each compile takes them and leaves them running,
    stopped on exit. Started per compile, each of a rank's four Interleaved1F1B graphs would wait again for new workers'
    imports (14-18 s on one H200). Yields whether the rank has workers."""
    global _lent
    if not start(pass_names, cfg, device):
        yield False
        return
    workers = take()
    workers.kept = True
    _lent = workers
    try:
        yield True
    finally:
        _lent = None
        workers.close()
