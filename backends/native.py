"""The native backends: our registered passes, then the FX graph runs as Python (`none`), with
Inductor on annotated regions (`regional`) or with Inductor on the whole graph (`full`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import fx

from graph_trainer.passes.registry import PassContext, apply_passes

from .base import register_backend

_EXTRA_PASSES = {
    "none": [],
    "regional": ["regional_inductor"],
    "full": ["inductor_decomposition", "full_inductor_compilation"],
}


@dataclass
class NativeBackend:
    name: str

    def pass_names(self, user_passes: list[str]) -> list[str]:
        # cudagraph must stay last: the Inductor stages go in front of it.
        head = [p for p in user_passes if p != "cudagraph"]
        tail = [p for p in user_passes if p == "cudagraph"]
        return head + [p for p in _EXTRA_PASSES[self.name] if p not in head] + tail

    def compile(self, gm: fx.GraphModule, ctx: PassContext) -> Callable[..., Any]:
        return apply_passes(gm, self.pass_names(ctx.cfg.compile.passes), ctx, "train_step")


for _name in _EXTRA_PASSES:
    register_backend(_name)(lambda n=_name: NativeBackend(n))
