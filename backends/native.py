"""The native backends: our registered passes, then the FX graph runs as Python (`none`), with
Inductor on annotated regions (`regional`) or with Inductor on the whole graph (`full`).

Each backend is its pass list: the user's `--compile.passes` with the backend's own passes inserted
before the first pass that must be last (cudagraph wraps the compiled step, so it stays behind them).
A user pass the backend runs anyway is taken once, in the backend's place. Every stage is dumped by
`apply_passes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from graph_trainer.passes import compile_workers
from graph_trainer.passes.inductor import warm_compile_pool
from graph_trainer.passes.registry import PASSES, PassContext, apply_passes

from .base import register_backend

_BACKEND_PASSES = {
    "none": [],
    "regional": ["regional_inductor"],
    "full": ["inductor_decomposition", "full_inductor_compilation"],
}


@dataclass
class NativeBackend:
    name: str

    def pass_names(self, user_passes: list[str]) -> list[str]:
        own = _BACKEND_PASSES[self.name]
        rest = [p for p in user_passes if p not in own]
        at = next((i for i, p in enumerate(rest) if p in PASSES and PASSES[p].must_be_last), len(rest))
        return rest[:at] + own + rest[at:]

    def prepare(self, cfg: Any, device: torch.device) -> None:
        # with compile workers this process only loads what they compile: its own pool would only slow the trace
        if not compile_workers.start(self.pass_names(cfg.compile.passes), cfg, device) and self.name != "none":
            warm_compile_pool(device)

    def compile(self, gm: fx.GraphModule, ctx: PassContext) -> Callable[..., Any]:
        return apply_passes(gm, self.pass_names(ctx.cfg.compile.passes), ctx, "train_step")


for _name in _BACKEND_PASSES:
    register_backend(_name)(lambda n=_name: NativeBackend(n))
