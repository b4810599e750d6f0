"""Backends: where a traced train-step graph goes to become the callable that runs a step.

Installed as `graph_trainer.backends` (a plain top-level `backends` would clash with an unrelated
PyPI package).
"""

from .base import Backend, get_backend, register_backend, backend_names

__all__ = ["Backend", "get_backend", "register_backend", "backend_names"]
