"""A traced graph as bytes and back, with every node's fake value and metadata: for the trace cache (a restart
loads the step instead of tracing it) and for the compile workers (a piece of the step compiled in another
process).

Torch's `GraphPickler` reductions (a fake tensor as its metadata, views kept; an op by its name; a graph module node
by node with its metadata), run on the C pickler: `GraphPickler` itself derives from dill's pure-Python pickler where
dill is installed (torchtitan's `datasets` installs it), 1.56 s against 0.41 s for llama3's debug model cut to 8
layers (2,233 nodes, CPU). What `dumps` writes, `GraphPickler.loads` reads.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from typing import Any

from torch import fx

from .passes.compat import FakeTensorMode, LazyGraphModule, graph_pickler

OPTIONS = graph_pickler.Options(ops_filter=None)
"""Every op is allowed: the step's collectives and graph_trainer's own ops resolve by name at load, where the package
that registers them is imported."""


class _Pickler(pickle.Pickler):
    """GraphPickler's reductions on the C pickler. GraphPickler's state (options, the fake tensor describer, ...) is
    read from one of its own, under whatever names this torch gives it."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        own = graph_pickler.GraphPickler
        state = {k: v for k, v in vars(own).items() if not k.startswith("__") and not isinstance(v, (classmethod, staticmethod))
                 and not callable(v)}
        self.__dict__.update({**state, **vars(own(io.BytesIO(), OPTIONS))})

    def reducer_override(self, obj: object) -> Any:
        return graph_pickler.GraphPickler.reducer_override(self, obj)

    def persistent_id(self, obj: object) -> str | None:
        return graph_pickler.GraphPickler.persistent_id(self, obj)


def dumps(gm: fx.GraphModule) -> bytes:
    # torch 2.13's GraphPickler registers slices with pytree while it pickles (torch 2.11 has no such patch)
    slices = getattr(graph_pickler, "patch_pytree_map_over_slice", contextlib.nullcontext)
    with slices(), io.BytesIO() as stream:
        try:
            _Pickler(stream).dump(gm)
            return stream.getvalue()
        except Exception:  # noqa: BLE001  (a torch whose GraphPickler works otherwise: its own, slower pickler)
            return graph_pickler.GraphPickler.dumps(gm, OPTIONS)


def loads(data: bytes) -> fx.GraphModule:
    """The graph `dumps` wrote, its values fake tensors of a new fake mode, as a lazy graph module (as make_fx returns
    one: passes that recompile a graph several times then write its code only when it is called)."""
    loaded = graph_pickler.GraphPickler.loads(data, FakeTensorMode(allow_non_fake_inputs=False))
    return LazyGraphModule(loaded, loaded.graph)
