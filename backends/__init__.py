"""Backends: where a traced train-step graph goes to become the callable that runs a step.

Installed as `graph_trainer.backends` (a plain top-level `backends` would clash with an unrelated
PyPI package).
"""

from .base import Backend, get_backend, register_backend, backend_names
from . import native  # noqa: F401,E402  (each backend module registers itself on import)
from . import autoparallel  # noqa: F401,E402

__all__ = ["Backend", "get_backend", "register_backend", "backend_names"]
