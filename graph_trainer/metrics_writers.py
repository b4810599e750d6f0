"""Where else rank 0's per-step figures go, next to metrics.jsonl: TensorBoard and Weights & Biases,
through torchtitan's loggers. Each logged step becomes one scalar per figure, tagged with its
metrics.jsonl key."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SCALARS = ("loss", "grad_norm", "lr", "tokens_per_second", "mfu", "peak_memory_gib", "step_time_s", "dropped_tokens",
           "validation_loss", "validation_perplexity")
"""The record keys written as scalars (those a record holds; `mfu` is absent on CPU, `dropped_tokens` for dense
models, the validation figures at the steps that validated)."""

TB_FOLDER = "tb"


def wandb_missing() -> bool:
    return importlib.util.find_spec("wandb") is None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(record[k]) for k in SCALARS if record.get(k) is not None}


class MetricWriters:
    """No-op unless enabled, and on ranks other than 0."""

    def __init__(self, cfg: Any, is_rank0: bool):
        self.loggers: list[Any] = []
        if not is_rank0:
            return
        m, folder = cfg.metrics, Path(cfg.job.dump_folder)
        if m.enable_tensorboard:
            from torchtitan.components.metrics import TensorBoardLogger

            self.loggers.append(TensorBoardLogger(str(folder / TB_FOLDER)))
        if m.enable_wandb:
            from torchtitan.components.metrics import WandBLogger

            # torchtitan's logger names the project "torchtitan" unless WANDB_PROJECT says otherwise.
            os.environ.setdefault("WANDB_PROJECT", "graph-trainer")
            config = SimpleNamespace(to_dict=lambda: dataclasses.asdict(cfg))
            self.loggers.append(WandBLogger(str(folder / "wandb"), config))

    def write(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        for logger in self.loggers:
            logger.log(values, record["step"])

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
