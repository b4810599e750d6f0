"""One compile worker's process (passes/compile_workers.py starts them): it compiles the piece each line of its stdin
names into the job's compile cache and answers one line per piece on stdout, until stdin closes."""

from __future__ import annotations

import importlib
import json
import pickle
import sys
import time
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from .. import compile_cache, graph_pickle
from ..metrics import process_age_s
from ..parallel.compat import fake_groups_named
from .compile_workers import REPLY
from .inductor import compile_graph, decompose

OPS = ("graph_trainer.parallel.moe_dispatch", "graph_trainer.autoparallel.moe", "graph_trainer.passes.offload_ops",
       "graph_trainer.losses", "torch.distributed._symmetric_memory")
"""The modules that register the ops a piece may call, imported before a piece is unpickled: graph_trainer's own, and
torch's fused async-TP ops (`async_tp`), which torch 2.11 defines only when its symmetric-memory module is imported
(on 2 H200s, without it, 7 of 11 pieces of llama3 8B-16L at tp 2 failed in the workers with "'symm_mem' object has no
attribute 'fused_all_gather_matmul'" and were compiled by the rank: 30 s to step 1 against 22 s without async_tp)."""


def _warm_up(device: torch.device) -> None:
    """Compile a small graph on the rank's GPU while the rank still traces its step: a process's first compile
    pays for its CUDA context, Inductor's lazily imported parts, its pool of Triton compile processes and
    Triton's own first kernel (on one H200, llama3 8B, every worker's first piece took 6.5-7.3 s whether it had
    46 or 166 nodes; a later piece of 24 nodes 0.2 s). The compile is not kept."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with FakeTensorMode():
        x = torch.empty(4096, 64, device=device)
        gm = make_fx(lambda t: (t.relu() * t.sum(1, keepdim=True), t.amax(0)), tracing_mode="real")(x)
    # as a piece's: in a fake mode with a ShapeEnv, which Inductor's caches need
    inputs = compile_cache.cacheable_inputs([x])
    compile_graph(decompose(gm, inputs), inputs, None)


def serve(device: str = "cpu") -> None:
    """Compile the job whose file each line of stdin names, answer one line per job, until stdin closes. On a
    GPU, warm up first (`_warm_up`)."""
    for module in OPS:
        importlib.import_module(module)
    if torch.device(device).type == "cuda":
        try:
            _warm_up(torch.device(device))
        except Exception as e:  # noqa: BLE001  (a worker that cannot warm up still takes pieces; it says why on its log)
            print(f"warm-up failed: {compile_cache.first_line(e)}", file=sys.stderr, flush=True)
    # seconds from the process's start to here, where it can take pieces
    ready = process_age_s()
    groups = None
    for line in sys.stdin:
        job = pickle.loads(Path(line.strip()).read_bytes())
        error, start = "", time.perf_counter()
        try:
            if job["groups"] is not None and job["groups"] != groups:
                groups = job["groups"]
                fake_groups_named(groups["world"], groups["rank"], groups["ranks"])
            torch._inductor.config.load_config(job["config"])
            gm = graph_pickle.loads(job["graph"])
            inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
            devices = {x.device for x in inputs if x.device.type == "cuda"}
            if devices:
                torch.cuda.set_device(devices.pop())
            cacheable = compile_cache.cacheable_inputs(inputs)
            if cacheable is None:
                raise ValueError("the piece's inputs are not cacheable")
            artifact = compile_graph(decompose(gm, inputs), cacheable, job["options"])
            if not compile_cache.CompileCache(Path(job["folder"])).store(job["key"], artifact, job["parts"]):
                error = "the compiled piece could not be stored"
        except Exception as e:  # noqa: BLE001  (the pass compiles the piece itself)
            error = compile_cache.first_line(e)
        print(REPLY + json.dumps({"key": job["key"], "error": error, "seconds": time.perf_counter() - start, "ready": ready}), flush=True)
