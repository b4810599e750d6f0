"""How long the GPUs wait on the host between steps: our trainer's step as it runs (`train_step`, whose loss and grad
norm are read on the host, then the stop-signal all-reduce read too: two host syncs a step), against the same step
queued without reading anything until the end (the host queues the next step while the GPUs run this one). Under
torchrun, the train flags as arguments; prints ms a step for each, in alternating rounds.

    torchrun --nproc_per_node 2 bench/results/2026-11-30-session29/call3/ahead.py <train flags>
"""
import math
import sys
import time

import torch
import torch.distributed as dist

from graph_trainer.checkpoint import any_rank
from graph_trainer.capture import own_grad_norm
from graph_trainer.clipping import clip_grad_norm_
from graph_trainer.config import parse_args
from graph_trainer.trainer import GraphTrainer

trainer = GraphTrainer(parse_args(sys.argv[1:]))


def queued() -> None:
    t = trainer
    t.step += 1
    t.optimizers.zero_grad()
    t.step_fn(*t.next_batches(0))
    if own_grad_norm(t.step_fn) is None:
        clip_grad_norm_(list(t.model.parameters()), t.cfg.training.max_norm or math.inf, ep_enabled=t.degrees.ep > 1)
    t.optimizers.step()
    t.lr_schedulers.step()


def synced() -> None:
    trainer.step += 1
    trainer.train_step()
    any_rank(False, trainer.device)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, n: int) -> float:
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - start) / n * 1e3


for _ in range(3):
    synced()
for r in range(3):
    a, b = timed(synced, 10), timed(queued, 10)
    if dist.get_rank() == 0:
        print(f"round {r}: synced {a:.1f} ms a step, queued {b:.1f} ms ({a / b:.3f}x)", flush=True)
dist.destroy_process_group()
