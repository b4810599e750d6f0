"""Throughput and MFU are per GPU, as torchtitan reports them: the ranks of a tensor-parallel group
work on the same tokens, so a rank's tokens per step are shared among the tp ranks."""

import pytest
import torch

from graph_trainer.metrics import MetricsLogger
from helpers import run_train

SEQ, BATCH = 64, 2


def test_tp2_reports_tokens_per_gpu(tmp_path):
    records = run_train(["--parallelism.dp_shard", "1", "--parallelism.tp", "2", "--training.steps", "3",
                         "--training.seq_len", str(SEQ), "--training.batch_size", str(BATCH)], tmp_path, nproc=2)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        # dp = 1: each rank runs the whole batch, which its tp peer runs as well.
        rank_tokens_per_s = BATCH * SEQ / r["step_time_s"]
        assert r["tokens_per_second"] == pytest.approx(rank_tokens_per_s / 2, rel=1e-12)


def test_mfu_follows_per_gpu_throughput(tmp_path):
    logger = MetricsLogger(str(tmp_path), True, 1, flops_per_token=1000, device=torch.device("cpu"), world_size=4,
                           progress_bar=False, ranks_per_batch_shard=4)
    logger.peak = 1e6
    r = logger.log(1, 1.0, 1.0, 1e-3, tokens=4096, extra={})
    assert r["tokens_per_second"] == pytest.approx(4096 / 4 / r["step_time_s"], rel=1e-12)
    assert r["mfu"] == pytest.approx(100.0 * 1024 * 1000 / r["step_time_s"] / 1e6, rel=1e-12)
