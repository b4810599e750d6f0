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

from .. import compile_cache, graph_pickle
from ..parallel.compat import fake_groups_named
from .compile_workers import REPLY
from .inductor import compile_graph, decompose

OPS = ("graph_trainer.parallel.moe_dispatch", "graph_trainer.autoparallel.moe", "graph_trainer.passes.offload_ops")
"""The modules that register graph_trainer's own ops, which a piece may call: imported before a piece is unpickled."""


def serve() -> None:
    """Compile the job whose file each line of stdin names, answer one line per job, until stdin closes."""
    for module in OPS:
        importlib.import_module(module)
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
        print(REPLY + json.dumps({"key": job["key"], "error": error, "seconds": time.perf_counter() - start}), flush=True)
