"""autoparallel_backend: AutoParallel-style compilation of the train-step graph.

Its pass list, each stage dumped by `apply_passes`, runs after the capture's own `reshard_after_forward`
(the graph it gets already holds the backward all-gathers `--parallelism.reshard_after_forward` asks for):
1. the user's `--compile.passes` (graph passes; they see one collective per parameter);
2. `autoparallel_scheduling`: its own schedule of the collectives on the aten graph, bucket sizes
   and the issue point of every bucket chosen by the simulated step time under the cost model
   (alpha-beta collectives on the mesh's links, roofline compute of the graph as Inductor will fuse it);
3. `inductor_decomposition` + `full_inductor_compilation`: Inductor compiles the whole graph,
   collectives included, in the order step 2 left them;
4. a user's `cudagraph` (or any pass that must be last) stays last.

`--compile.autoparallel_impl meta` makes step 2 run Meta AutoParallel's aten bucketing/reordering
pass instead of ours (when the package is installed; `check_config` refuses it up front otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from graph_trainer.config import ConfigError, JobConfig
from graph_trainer.passes.bucketing_compat import META_AUTOPARALLEL_INSTALL, meta_autobucketing
from graph_trainer.passes import compile_workers
from graph_trainer.passes.inductor import warm_compile_pool
from graph_trainer.passes.registry import PASSES, PassContext, apply_passes

from .base import register_backend

NAME = "autoparallel_backend"
SCHEDULE_AND_COMPILE = ["autoparallel_scheduling", "inductor_decomposition", "full_inductor_compilation"]


def check_config(cfg: JobConfig) -> None:
    """Up-front check (no process group yet): the meta implementation needs Meta's package."""
    if cfg.compile.inductor_compilation == NAME and cfg.compile.autoparallel_impl == "meta" and meta_autobucketing() is None:
        raise ConfigError(
            f"--compile.autoparallel_impl meta needs Meta's autoparallel package, which is not importable: "
            f"{META_AUTOPARALLEL_INSTALL}; or use --compile.autoparallel_impl builtin"
        )


@dataclass
class AutoParallelBackend:
    name: str = NAME

    def pass_names(self, user_passes: list[str]) -> list[str]:
        own = SCHEDULE_AND_COMPILE
        rest = [p for p in user_passes if p not in own]
        at = next((i for i, p in enumerate(rest) if p in PASSES and PASSES[p].must_be_last), len(rest))
        return rest[:at] + SCHEDULE_AND_COMPILE + rest[at:]

    def prepare(self, cfg: Any, device: torch.device) -> None:
        # with compile workers this process only loads what they compile: its own pool would only slow the trace
        if not compile_workers.start(self.pass_names(cfg.compile.passes), cfg, device):
            warm_compile_pool(device)

    def compile(self, gm: fx.GraphModule, ctx: PassContext) -> Callable[..., Any]:
        check_config(ctx.cfg)
        return apply_passes(gm, self.pass_names(ctx.cfg.compile.passes), ctx, "train_step")


register_backend(NAME)(AutoParallelBackend)
