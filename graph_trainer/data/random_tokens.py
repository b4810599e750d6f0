"""Random token batches for throughput benchmarks, reproducible from (seed, step, dp rank, microbatch)
alone, so another trainer (bench/titan_spec.py feeds torchtitan) can be given exactly the same tokens."""

from __future__ import annotations

import torch


def random_batch(seed: int, step: int, microbatch: int, dp_rank: int, local_batch: int, seq_len: int,
                 vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = ((seed * 1_000_003 + step) * 1_009 + microbatch) * 65_537 + dp_rank
    tokens = torch.randint(0, vocab_size, (local_batch, seq_len + 1), generator=torch.Generator().manual_seed(key))
    return tokens[:, :-1], tokens[:, 1:]
