"""The backend interface and its registry.

A backend takes the traced train-step graph, its example inputs and a `PassContext` (config, mesh,
placements) and returns the callable that runs one step with the same inputs and outputs. The trainer
and the capture modes only call `get_backend(name).compile(...)`. The registry knows no backend:
each registers itself, and the package (`__init__.py`) imports them all.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch import fx

from graph_trainer.passes.registry import PassContext


class Backend(Protocol):
    name: str

    def pass_names(self, user_passes: list[str]) -> list[str]:
        """The full, ordered pass list this backend runs for the user's `--compile.passes`."""

    def prepare(self, cfg: Any, device: torch.device) -> None:
        """Start what the compile will need and the graph does not decide (processes), before the step is traced."""

    def compile(self, gm: fx.GraphModule, ctx: PassContext) -> Callable[..., Any]:
        """Transform and compile the train-step graph, through `apply_passes` (which prices it for prediction.json);
        the result is called with the graph's inputs."""


_BACKENDS: dict[str, Callable[[], Backend]] = {}


def register_backend(name: str) -> Callable[[Callable[[], Backend]], Callable[[], Backend]]:
    def deco(factory: Callable[[], Backend]) -> Callable[[], Backend]:
        _BACKENDS[name] = factory
        return factory

    return deco


def backend_names() -> list[str]:
    return list(_BACKENDS)


def get_backend(name: str) -> Backend:
    return _BACKENDS[name]()
