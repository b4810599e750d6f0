"""`--comm.mode fake`: one process runs one rank of an N-rank job on torch's fake process group.

What the README promises and these tests hold it to: the simulated rank's traced graph, collectives
and parameter shards are those of the same rank in a real N-rank run; runs of 8 and 64 ranks train
on one CPU process; every metrics record says the run is fake; bad inputs stop with one line, exit 2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from graph_trainer.metrics import read_metrics
from helpers import child_env, grad_norms, launch, run_train

SMALL = ["--training.seq_len", "64", "--training.steps", "2", "--compile.mode", "aot_fx_trace", "--compile.dump_graphs"]


def _collectives(folder: Path) -> dict:
    return json.loads((folder / "graphs" / "summary.json").read_text())["stages"][0]["collectives"]


def _input_shapes(folder: Path) -> list[str]:
    """The traced step's inputs in order: local parameter shards, buffers, then the batch."""
    signature = next(line for line in (folder / "graphs" / "00_traced.py").read_text().splitlines() if "def forward" in line)
    return re.findall(r'arg\d+_1: "([^"]+)"', signature)


def _fake_and_real(tmp_path: Path, args: list[str], ranks: int) -> tuple[Path, Path]:
    fake, real = tmp_path / "fake", tmp_path / "real"
    fake_records = run_train([*args, "--comm.mode", "fake", "--comm.fake_world_size", str(ranks)], fake)
    real_records = run_train(args, real, nproc=ranks)
    assert [r["comm_mode"] for r in fake_records] == ["fake"] * len(fake_records)
    assert [r["comm_mode"] for r in real_records] == ["real"] * len(real_records)
    return fake, real


@pytest.mark.slow
def test_llama_fake_rank0_of_dp2_tp2_traces_the_graph_of_real_rank0(tmp_path):
    fake, real = _fake_and_real(tmp_path, [*SMALL, "--parallelism.dp_shard", "2", "--parallelism.tp", "2", "--training.batch_size", "4"], 4)
    collectives = _collectives(fake)
    assert collectives == _collectives(real)
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= set(collectives)
    assert (fake / "placements.json").read_text() == (real / "placements.json").read_text()
    # Same ops, shapes and process groups node for node: the fake run is rank 0 of the real job.
    assert (fake / "graphs" / "00_traced.py").read_text() == (real / "graphs" / "00_traced.py").read_text()
    # Fake values stay at the real job's scale: a fake tp partial sum holds one of the 2 ranks' shares, so
    # within a factor 2 (measured 0.70x). Embedding rows left zero by the vocab-parallel reduce-scatter
    # made it 1.7e7 at step 1 (tokens_in_vocab_shard); at 8B sizes the gradients overflowed to NaN.
    for fake_norm, real_norm in zip(grad_norms(read_metrics(fake)), grad_norms(read_metrics(real))):
        assert real_norm / 2 < fake_norm < 2 * real_norm


def test_fake_rank0_reading_its_embedding_in_place_has_real_rank0s_collectives_at_its_scale(tmp_path):
    # --parallelism.embedding vocab: the fake reduce-scatter returns the rank's own lookups, so its tokens are moved
    # into its rows as under tp; without that, half of them started from zero and the gradient norm blew up
    fake, real = _fake_and_real(tmp_path, [*SMALL, "--parallelism.dp_shard", "2", "--parallelism.embedding", "vocab",
                                           "--training.batch_size", "2"], 2)
    # the graphs differ in the token input's strides only (the real batch is a slice of its sequences, the moved one not)
    assert _collectives(fake) == _collectives(real)
    assert (fake / "placements.json").read_text() == (real / "placements.json").read_text()
    for fake_norm, real_norm in zip(grad_norms(read_metrics(fake)), grad_norms(read_metrics(real)), strict=True):
        assert real_norm / 2 < fake_norm < 2 * real_norm


@pytest.mark.slow
def test_deepseek_fake_rank0_of_dp_shard_x_ep_has_real_rank0_collectives_and_shards(tmp_path):
    args = ["--config", "configs/deepseek_v3_debug.toml", *SMALL, "--parallelism.dp_shard", "4", "--parallelism.ep", "2",
            "--training.batch_size", "4"]
    fake, real = _fake_and_real(tmp_path, args, 4)
    collectives = _collectives(fake)
    assert collectives == _collectives(real)
    assert collectives["all_to_all"]["count"] > 0
    assert (fake / "placements.json").read_text() == (real / "placements.json").read_text()
    # The fake graph bounds the received expert counts (uninitialised on the fake process group) with a
    # few integer ops, so the graphs differ there; parameter shards and batch shapes do not.
    assert _input_shapes(fake) == _input_shapes(real)


@pytest.mark.parametrize("ranks", [8, 64])
def test_fake_runs_of_many_ranks_train_three_steps_on_local_shards(tmp_path, ranks):
    # ranks=8 is the README's check command.
    records = run_train(["--comm.mode", "fake", "--comm.fake_world_size", str(ranks), "--parallelism.dp_shard", str(ranks),
                         "--training.batch_size", str(ranks), "--training.seq_len", "64", "--compile.mode", "aot_fx_trace",
                         "--compile.dump_graphs", "--training.steps", "3"], tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["comm_mode"] == "fake" for r in records)
    # llama3 debugmodel: vocab 2048 x dim 256 embedding, one shard of ranks rows per rank; batch 1 x 64 per rank.
    shapes = _input_shapes(tmp_path)
    assert shapes[0].startswith(f"f32[{2048 // ranks}, 256]")
    assert shapes[-1].startswith("i64[1, 64]")
    gathers = _collectives(tmp_path)["all_gather"]
    assert gathers["count"] > 0


def test_fake_rank_materialises_its_own_shard_and_mesh_coordinates():
    from graph_trainer import models
    from graph_trainer.parallel import parallelize
    from graph_trainer.parallel.compat import init_fake_process_group
    from graph_trainer.parallel.materialize import materialize
    from graph_trainer.parallel.mesh import Degrees, build_meshes
    from graph_trainer.parallel.simple_fsdp import MixedPrecision

    spec = models.get_spec("llama3")
    args = spec.args_for("debugmodel", 64, 0)

    def wq_on(degrees: Degrees, rank: int) -> torch.Tensor:
        init_fake_process_group(degrees.world_size, rank)
        meshes = build_meshes(degrees, "cpu")
        if degrees.world_size == 4:
            assert meshes.dp_rank() == 1 and meshes.dense.get_local_rank("tp") == 1
        model = parallelize(models.build_on_meta(spec, args, "cpu"), spec, meshes, MixedPrecision(torch.float32, torch.float32))
        materialize(model, models.build_on_meta(spec, args, "cpu"), torch.device("cpu"), seed=0)
        return dict(model.named_parameters())["layers.0.attention.wq.weight"].to_local()

    try:
        local, full = wq_on(Degrees(1, 2, 2, 1), rank=3), wq_on(Degrees(1, 1, 1, 1), rank=0)
    finally:
        torch.distributed.destroy_process_group()
    # rank 3 = (dp_shard 1, tp 1) holds the second half of wq's output rows (tp: Shard(0)) and of its
    # input columns (dp_shard: Shard(1), the dimension TP leaves alone).
    assert full.shape == (256, 256) and torch.equal(local, full[128:, 128:])


@pytest.mark.parametrize(
    "args, env, needle",
    [
        (["--comm.fake_world_size", "4", "--comm.fake_rank", "4"], {}, "pick --comm.fake_rank in 0..3"),
        (["--comm.fake_world_size", "0"], {}, "comm.fake_world_size must be >= 1"),
        (["--comm.fake_world_size", "2"], {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "run it without torchrun"),
        (["--comm.fake_world_size", "2", "--checkpoint.enable"], {}, "cannot checkpoint"),
        (["--comm.fake_world_size", "4", "--parallelism.dp_shard", "3"], {}, "there are 4 ranks"),
    ],
)
def test_bad_fake_runs_stop_with_one_line(tmp_path, args, env, needle):
    proc = launch(["train", "--comm.mode", "fake", "--job.dump_folder", str(tmp_path), *args], env=child_env(**env))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "graph-trainer: error:" in lines[0], proc.stderr
    assert needle in proc.stderr


def test_fake_flags_without_fake_mode_are_refused(tmp_path):
    proc = launch(["train", "--comm.fake_world_size", "8", "--job.dump_folder", str(tmp_path)])
    assert proc.returncode == 2
    assert "add --comm.mode fake" in proc.stderr
