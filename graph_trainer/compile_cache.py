"""The compile cache: a whole-graph Inductor compile stored on disk, so the next start of the same job
loads it instead of compiling (`--compile.cache_dir`).

What is stored is `standalone_compile`'s artifact (`CompiledArtifact.save(format="binary")`: the
AOTAutograd and Inductor cache entries it made, the generated code and, on GPUs, the compiled Triton
kernels). Measured, cold compile against warm load (the `full_inductor_compilation` pass):
- llama3 1B (16 layers, 5 distinct pieces), 2 x 2048, one H100, torch 2.11: 17.6 s against 1.1 s
  (time to first step 24.9 s against 8.8 s); 1.2 s with Inductor's own cache folder emptied, so the
  Triton kernels come from the entry. 1B on 2 H100s (dp_shard 2, NCCL), the job restarted: 16.8 s
  against 2.3 s, time to first step 48.4 s against 15.3 s, 10 of 10 pieces loaded on both ranks.
- debug model, torch 2.13 CPU (one process on a loaded 2-core machine): 6 layers, seq 64: 37.6 s
  against 8.9 s; 2 layers, seq 32: 10-22 s against 3.0-6.5 s with Inductor's kernel cache warm. With
  it empty the load took 62 s: on CPU the entry holds the C++ source, built again where the library
  is not on disk. `aot=True`'s bundled artifact loaded in 4.6 s / 116 s under the same conditions,
  so the default artifact is kept.
Torch's portable cache (`torch.compiler.save_cache_artifacts`) is what the artifact carries inside,
with the lookup key besides: used bare it would still need the compile's own inputs to find its
entry. For any of them the AOTAutograd cache must accept the graph, which it refuses when the
tracing fake mode has no ShapeEnv ("No shape env"): `cacheable_inputs` gives the compile one, with
static shapes, so the compiled code is the same. `CompiledArtifact.save/load` behave the same on
torch 2.11 and 2.13 (checked: save in one process, load in another, same outputs).

The key is everything the compiled code depends on: the graph as the compile gets it (after every
graph pass, so what the passes decided is part of it; ops, arguments, constants, the shape, stride,
dtype and device of every value; for a piece of a block-reused step, the piece before Inductor's
decomposition, which torch's version decides: passes/inductor.py, `PieceEntry`), the inputs' shapes, strides, dtypes and devices, the Inductor
options and configuration, torch (version and source hash), Triton and Python versions, the device
kind (GPU name and capability, or the CPU's vector ISA, which the generated C++ is written for) and
the mesh (shape and dimension names).

The rank is not part of the key. What the rank changes in the compiled code is already in the graph:
the collectives' group names (on a mesh of one dimension every rank's groups have the same names; on
more dimensions each rank's groups are its own, so the graphs differ) and any constant that depends
on the rank's shard; and the device index (a GPU's local rank), which the inputs' devices carry and
which the generated code pins. Ranks whose graphs are equal share one entry; ranks whose graphs
differ get entries of their own. A graph that depends on a measurement (the overlap schedule planned
with the link figures probed at start-up on GPUs) gets a new key, and so a compile, when the
measurement changes the plan: a miss, never a wrong step.

An entry is one file, `<key>.bin`: a header line, a JSON line (key, payload size and SHA-256, the
key's parts) and the payload. It is written to a temporary file and renamed into place, so a reader
sees a whole entry or none, and ranks that store the same key at once each rename a whole entry. An
entry that is truncated, corrupt or that torch cannot load is one warning line and a fresh compile.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._library.fake_class_registry import FakeScriptObject
from torch.utils import _pytree as pytree

from .passes.compat import CompiledArtifact, FakeTensor, FakeTensorMode, ShapeEnv, cpu_vector_isa, triton_version

logger = logging.getLogger("graph_trainer")

_MAGIC = b"graph-trainer compile cache 1\n"


def value_key(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return ("tensor", tuple(val.shape), val.stride(), str(val.dtype), str(val.device))
    if isinstance(val, (list, tuple)):
        return [value_key(v) for v in val]
    if isinstance(val, FakeScriptObject):
        # an opaque input (a pipeline stage's graph from AOTAutograd has some): the compiled code passes it
        # through; its repr holds its address, which differs at every start
        return ("opaque", val.script_class_name)
    return repr(val)


def _constant(module: fx.GraphModule, target: str) -> str:
    """A `get_attr`'s value as text: a subgraph's own fingerprint, a tensor's metadata and bytes."""
    value = module
    for part in target.split("."):
        value = getattr(value, part)
    if isinstance(value, fx.GraphModule):
        return graph_fingerprint(value)
    if isinstance(value, torch.Tensor):
        data = ""
        if value.device.type != "meta" and not isinstance(value, torch._subclasses.FakeTensor):
            flat = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            data = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
        return repr((value_key(value), data))
    return repr(value)


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """SHA-256 of what the compiled code depends on in `gm`: every node's op, target, arguments and
    value (shape, stride, dtype, device), and the constants and subgraphs it reads. Node metadata
    that only annotates (stack traces, region marks) is left out."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        target = _constant(gm, node.target) if node.op == "get_attr" else str(node.target)
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: f"%{a.name}")
        h.update(repr((node.op, node.name, target, args, value_key(node.meta.get("val")))).encode())
        h.update(b"\n")
    return h.hexdigest()


def device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
    return f"{device.type} {cpu_vector_isa()}"


def _mesh(meshes: Any) -> Any:
    if meshes is None:
        return None
    found = [m for m in (meshes.dense, meshes.sparse) if m is not None]
    return [(tuple(m.shape), tuple(m.mesh_dim_names or ())) for m in found]


def cache_key(gm: fx.GraphModule, inputs: list[Any], options: dict | None, device: torch.device,
              meshes: Any) -> tuple[str, dict]:
    """The key of `gm`'s compile with these inputs and Inductor options, and the parts it hashes."""
    with torch._inductor.config.patch((options or {}).get("config_patches", {})):
        inductor_config = torch._inductor.config.get_hash().hex()
    parts = {
        "graph": graph_fingerprint(gm),
        "inputs": [value_key(x) for x in inputs],
        "options": repr(options),
        "inductor_config": inductor_config,
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "triton": triton_version(),
        "python": sys.version.split()[0],
        "device": device_kind(device),
        "mesh": _mesh(meshes),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest(), parts


def cacheable_inputs(inputs: list[Any]) -> list[Any] | None:
    """Fakes of `inputs` in a fake mode with a ShapeEnv and static shapes (see the module docstring), tensors
    inside containers too; None where a fake tensor of another mode is left among them (held by an object
    that is no tensor nor container), which the compile cannot be given beside the new ones."""
    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    with mode:
        fresh = pytree.tree_map_only(torch.Tensor, lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                                                                 device=x.device), inputs)
    return fresh if fake_mode_of(fresh) is mode else None


def fake_mode_of(inputs: list[Any]) -> FakeTensorMode | None:
    """The one fake mode of the fake tensors among `inputs` (None: none, or several). Not torch's
    `detect_fake_mode`, which answers the ambient tracing context's mode first: a pipeline stage's graph
    is compiled inside AOTAutograd's, whose mode is not the one these inputs were made in."""
    modes = {id(t.fake_mode): t.fake_mode for t in pytree.tree_leaves(inputs) if isinstance(t, FakeTensor)}
    return next(iter(modes.values())) if len(modes) == 1 else None


class Refused(Exception):
    """An entry exists but cannot be used; the message says why."""


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


@dataclass
class CompileCache:
    folder: Path

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.bin"

    def read(self, key: str) -> bytes | None:
        """The payload stored under `key`, or None when there is none; `Refused` when the entry is unusable."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if not data.startswith(_MAGIC):
            raise Refused("not a compile cache entry")
        end = data.find(b"\n", len(_MAGIC))
        try:
            header = json.loads(data[len(_MAGIC):end])
        except ValueError:
            raise Refused("truncated or corrupt header") from None
        payload = data[end + 1:]
        if header.get("key") != key:
            raise Refused("stored under another key")
        if len(payload) != header.get("size"):
            raise Refused(f"truncated: {len(payload):,} of {header.get('size'):,} bytes")
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise Refused("checksum mismatch")
        return payload

    def load(self, key: str) -> Any:
        """The stored compile of `key`, or None when there is none; `Refused` when the entry is unusable."""
        payload = self.read(key)
        if payload is None:
            return None
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".load", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            return CompiledArtifact.load(path=tmp, format="binary")
        except Exception as e:  # noqa: BLE001  (whatever torch raises on a bad artifact means: compile afresh)
            raise Refused(f"torch could not load it ({first_line(e)})") from e
        finally:
            os.unlink(tmp)

    def write(self, key: str, payload: bytes, parts: dict) -> None:
        """Write `payload` under `key` as one file, renamed into place so a reader sees a whole entry or none."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{key[:16]}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        header = {"key": key, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest(), "parts": parts}
        try:
            tmp.write_bytes(_MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload)
            os.replace(tmp, self.path(key))
        finally:
            tmp.unlink(missing_ok=True)

    def store(self, key: str, artifact: Any, parts: dict) -> bool:
        """Write `artifact` under `key`; False, with one warning line, when it cannot be saved."""
        self.folder.mkdir(parents=True, exist_ok=True)
        raw = self.folder / f".{key[:16]}.{os.getpid()}.{uuid.uuid4().hex[:8]}.artifact"
        try:
            artifact.save(path=str(raw), format="binary")
            self.write(key, raw.read_bytes(), parts)
            return True
        except Exception as e:  # noqa: BLE001  (a compile that cannot be stored still runs)
            logger.warning(f"compile cache: cannot store the compiled graph in {self.folder} ({first_line(e)}); the next start compiles it again")
            return False
        finally:
            raw.unlink(missing_ok=True)


REPORT_PASS = "full_inductor_compilation"


def record(report: dict[str, dict[str, Any]], outcome: str, loaded: int, written: int) -> None:
    """Fold one compiled graph's outcome into the pass's figures: `compile_cache` is "hit" when every
    graph was loaded, "miss" when any was compiled, "refused (why)" when an entry could not be used
    (the first reason), "off" with no cache; `compile_cache_entries_loaded` / `_written` count."""
    figures = report.setdefault(REPORT_PASS, {})
    before = figures.get("compile_cache")
    figures["compile_cache"] = outcome if before is None else max(before, outcome, key=_severity)
    figures["compile_cache_entries_loaded"] = figures.get("compile_cache_entries_loaded", 0) + loaded
    figures["compile_cache_entries_written"] = figures.get("compile_cache_entries_written", 0) + written


def _severity(outcome: str) -> int:
    return 3 if outcome.startswith("refused") else {"off": 0, "hit": 1, "miss": 2}[outcome]
