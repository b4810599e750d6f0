"""Step metrics: throughput, MFU, memory, and the files and log lines they go to.

Rank 0 writes `<dump_folder>/metrics.jsonl`, one object per logged step. Peak memory on the GPU is
the allocator's peak *active* bytes (reproducible between identical runs, unlike reserved bytes);
on the CPU it is the process's peak resident set size.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("graph_trainer")


def read_metrics(dump_folder: str | Path) -> list[dict[str, Any]]:
    """The records rank 0 wrote to `<dump_folder>/metrics.jsonl`; [] when it wrote none."""
    path = Path(dump_folder) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def process_age_s() -> float | None:
    """Seconds since this process started (from Linux's /proc; None elsewhere): what the imports, the flags and
    their validation took before the trainer's own clock starts."""
    try:
        stat = Path("/proc/self/stat").read_text()
        # fields after the command's closing parenthesis start at field 3; the start time (field 22) is in clock ticks since boot
        started = int(stat[stat.rindex(")") + 2 :].split()[19]) / os.sysconf("SC_CLK_TCK")
        return float(Path("/proc/uptime").read_text().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU from its spec sheet (torchtitan's table); None on CPU."""
    if device.type != "cuda":
        return None
    from torchtitan.tools.utils import get_peak_flops

    return get_peak_flops(torch.cuda.get_device_name(device))


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_stats(device).get("active_bytes.all.peak", 0) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLogger:
    def __init__(self, dump_folder: str, is_rank0: bool, total_steps: int, flops_per_token: int,
                 device: torch.device, world_size: int, progress_bar: bool, first_step: int = 1,
                 ranks_per_batch_shard: int = 1):
        """`ranks_per_batch_shard`: the ranks that work on the same tokens (the product of the mesh
        degrees that do not split the batch, i.e. tp): throughput and MFU are per GPU, as torchtitan
        reports them, so a rank's tokens are shared among them."""
        self.is_rank0 = is_rank0
        self.ranks_per_batch_shard = ranks_per_batch_shard
        self.flops_per_token = flops_per_token
        self.device = device
        self.world_size = world_size
        self.peak = peak_flops(device)
        self.path = Path(dump_folder) / "metrics.jsonl"
        self.bar = None
        if is_rank0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A resumed run keeps the records of the steps before it; later ones belong to the abandoned run.
            old = self.path.read_text().splitlines() if first_step > 1 and self.path.exists() else []
            self.path.write_text("".join(line + "\n" for line in old if line and json.loads(line)["step"] < first_step))
            if progress_bar and sys.stderr.isatty():
                from tqdm import tqdm

                self.bar = tqdm(total=total_steps, desc="train", unit="step", leave=False)
        self.last_time = time.perf_counter()

    def restart_clock(self) -> None:
        self.last_time = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Work between the step and its log that is not training (validation): not in the step's time or throughput."""
        self.last_time += seconds

    def log(self, step: int, loss: float, grad_norm: float, lr: float, tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
        """`tokens`: tokens this rank processed since the last call."""
        now = time.perf_counter()
        step_time = now - self.last_time
        self.last_time = now
        tps = tokens / self.ranks_per_batch_shard / step_time
        mfu = 100.0 * tps * self.flops_per_token / self.peak if self.peak else None
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_second": tps,
            "mfu": mfu,
            "peak_memory_gib": peak_memory_gib(self.device),
            "step_time_s": step_time,
            **extra,
        }
        if self.is_rank0:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            mfu_text = f"  mfu: {mfu:.2f}%" if mfu is not None else ""
            # A fake run's collectives move no data: its losses say nothing about the model.
            fake = " (fake comm: loss not meaningful)" if record.get("comm_mode") == "fake" else ""
            validation = f"  validation_loss: {record['validation_loss']:8.5f}" if "validation_loss" in record else ""
            line = (
                f"step: {step:4d}  loss: {loss:8.5f}{fake}  grad_norm: {grad_norm:8.4f}  lr: {lr:.2e}  "
                f"memory: {record['peak_memory_gib']:.2f}GiB  tps: {tps:,.0f}{mfu_text}{validation}"
            )
            if self.bar is not None:
                self.bar.update(1)
                self.bar.write(line)
            else:
                logger.info(line)
        return record

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
