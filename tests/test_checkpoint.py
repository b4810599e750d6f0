"""Checkpoint and resume: bitwise-equal resumes in every capture mode, resumes across modes,
activation-checkpointing settings and meshes, atomic saves, and refusal of damaged checkpoints.

A reference run trains 10 steps and saves at steps 5 and 10 (`--checkpoint.interval 5`); a resumed
run loads step 5 (`--checkpoint.load_step 5`) with the same `--training.steps 10`, so the LR schedule
is the same function of the step in both, and must reproduce steps 6..10 exactly. Stopping a run
with a signal and resuming it is tested in test_faults.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import grad_norms, launch, losses, read_metrics, run_train

from graph_trainer.checkpoint import CheckpointError, complete_checkpoints, select_checkpoint

SMALL = ["--training.batch_size", "4", "--training.seq_len", "64", "--model.n_layers", "2"]
TEN_STEPS = ["--training.steps", "10", "--checkpoint.enable", "--checkpoint.interval", "5"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "docs.txt"
    words = "in the beginning was the word and the word was with the graph and the graph was traced".split()
    docs = [" ".join(words[(i * 7 + j) % len(words)] for j in range(40 + i % 13)) for i in range(400)]
    path.write_text("\n\n".join(docs))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """`reference(mode, nproc=1, *extra)` -> dump folder of a 10-step run saving at 5 and 10 (cached)."""
    runs: dict[tuple, Path] = {}

    def get(mode: str, nproc: int = 1, *extra: str) -> Path:
        key = (mode, nproc, extra)
        if key not in runs:
            folder = tmp_path_factory.mktemp(f"ref_{mode}_{nproc}") / "run"
            run_train([*SMALL, "--training.dataset_path", str(data), "--compile.mode", mode, *TEN_STEPS, *extra], folder, nproc=nproc)
            runs[key] = folder
        return runs[key]

    return get


def resume(reference_folder: Path, tmp_path: Path, data: Path, *args: str, nproc: int = 1) -> list[dict]:
    """Copy a reference run's folder and resume it from step 5 with `args`; the resumed steps' records
    (metrics.jsonl may keep the records up to the resumed step)."""
    folder = tmp_path / "resumed"
    shutil.copytree(reference_folder, folder)
    records = run_train([*SMALL, "--training.dataset_path", str(data), *TEN_STEPS, "--checkpoint.load_step", "5", *args], folder, nproc=nproc)
    return [r for r in records if r["step"] > 5]


@pytest.mark.parametrize("mode, model", [
    ("eager", ()),
    ("aot_fx_trace", ()),
    pytest.param("jit", (), marks=pytest.mark.slow),
    pytest.param("aot", (), marks=pytest.mark.slow),
    pytest.param("eager", ("--model.name", "deepseek_v3"), id="eager-deepseek_v3", marks=pytest.mark.slow),
], ids=lambda v: v if isinstance(v, str) else "llama3")
def test_resume_is_bitwise(mode, model, reference, tmp_path, data):
    straight = read_metrics(reference(mode, 1, *model))
    resumed = resume(reference(mode, 1, *model), tmp_path, data, "--compile.mode", mode, *model)
    assert [r["step"] for r in resumed] == [6, 7, 8, 9, 10]
    assert losses(resumed) == losses(straight)[5:]
    assert grad_norms(resumed) == grad_norms(straight)[5:]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in straight[5:]]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "aot_fx_trace"])
def test_resume_is_bitwise_with_auto_placement(mode, reference, tmp_path, data):
    """aot with auto placement trains in test_autoparallel_backend.py; aot and jit resume in test_resume_is_bitwise
    (placement and capture meet in the checkpoint only through the parameters' placements, which these two cover)."""
    placed = ("--compile.autoparallel", "--parallelism.dp_shard", "2")
    straight = read_metrics(reference(mode, 2, *placed))
    resumed = resume(reference(mode, 2, *placed), tmp_path, data, "--compile.mode", mode, *placed, nproc=2)
    assert [r["step"] for r in resumed] == [6, 7, 8, 9, 10]
    assert losses(resumed) == losses(straight)[5:]
    assert grad_norms(resumed) == grad_norms(straight)[5:]


def test_resume_across_mode_and_activation_checkpointing(reference, tmp_path, data):
    """Saved in eager without AC; resumed traced, and in eager with every block wrapped (other FQNs)."""
    straight = losses(read_metrics(reference("eager")))
    traced = resume(reference("eager"), tmp_path / "traced", data, "--compile.mode", "aot_fx_trace")
    assert losses(traced) == pytest.approx(straight[5:], abs=1e-5)
    wrapped = resume(reference("eager"), tmp_path / "ac", data, "--activation_checkpoint.mode", "full",
                     "--checkpoint.keep_latest_k", "1")
    assert losses(wrapped) == pytest.approx(straight[5:], abs=1e-5)

    root = tmp_path / "ac" / "resumed" / "checkpoint"
    assert [step for step, _ in complete_checkpoints(root)] == [10], "keep_latest_k 1 keeps only the newest"
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(root / "step-10")).read_metadata().state_dict_metadata
    assert any(k.startswith("model.layers.0.") for k in keys)
    assert not [k for k in keys if "_checkpoint_wrapped_module" in k or "_orig_mod" in k]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["--parallelism.dp_shard", "4"], ["--parallelism.dp_shard", "2", "--parallelism.tp", "2"]],
                         ids=["dp_shard4", "dp_shard2_tp2"])
def test_resume_on_another_mesh(mesh, reference, tmp_path, data):
    """Saved on dp_shard=2 (2 ranks), resumed on 4 ranks: DCP reshards, the data position is re-derived."""
    straight = losses(read_metrics(reference("eager", 2, "--parallelism.dp_shard", "2")))
    resumed = resume(reference("eager", 2, "--parallelism.dp_shard", "2"), tmp_path, data, *mesh, nproc=4)
    assert [r["step"] for r in resumed] == [6, 7, 8, 9, 10]
    assert losses(resumed) == pytest.approx(straight[5:], abs=1e-5)


def test_corrupt_checkpoint_is_refused_unless_fallback(reference, tmp_path, data):
    """A byte flipped inside the latest checkpoint (sizes intact, so only the checksum can tell)."""
    folder = tmp_path / "run"
    shutil.copytree(reference("eager"), folder)
    shard = sorted((folder / "checkpoint" / "step-10").glob("*.distcp"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    args = ["train", "--job.dump_folder", str(folder), *SMALL, "--training.dataset_path", str(data), *TEN_STEPS]

    refused = launch(args)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert f"checkpoint {folder / 'checkpoint' / 'step-10'} is corrupt" in refused.stderr
    assert "--checkpoint.fallback_to_previous" in refused.stderr

    fell_back = launch([*args, "--checkpoint.fallback_to_previous"])
    assert fell_back.returncode == 0, fell_back.stderr[-3000:]
    assert "resumed from" in fell_back.stderr and "step-5" in fell_back.stderr
    assert losses([r for r in read_metrics(folder) if r["step"] > 5]) == losses(read_metrics(reference("eager")))[5:]


def _fake_checkpoint(root: Path, step: int, *, complete: bool = True, size_ok: bool = True) -> Path:
    folder = root / (f"step-{step}" if complete else f"step-{step}.tmp")
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x" * 10)
    meta = {"format": 1, "step": step, "files": {"__0_0.distcp": [10 if size_ok else 11, 0]}}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def test_only_complete_checkpoints_are_selected(tmp_path):
    root = tmp_path / "ckpt"
    assert select_checkpoint(root, -1, False) is None
    _fake_checkpoint(root, 2)
    _fake_checkpoint(root, 4)
    _fake_checkpoint(root, 6, complete=False)
    folder, meta = select_checkpoint(root, -1, False)
    assert folder.name == "step-4" and meta["step"] == 4
    assert select_checkpoint(root, 2, False)[0].name == "step-2"
    with pytest.raises(CheckpointError, match=r"no complete checkpoint step-6 .*complete steps: 2, 4"):
        select_checkpoint(root, 6, False)


def test_damaged_checkpoint_needs_fallback(tmp_path):
    root = tmp_path / "ckpt"
    _fake_checkpoint(root, 2)
    _fake_checkpoint(root, 4, size_ok=False)
    with pytest.raises(CheckpointError, match=r"step-4 is corrupt.*fallback_to_previous"):
        select_checkpoint(root, -1, False)
    assert select_checkpoint(root, -1, True)[0].name == "step-2"
    (root / "step-2" / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="every checkpoint in .* is corrupt"):
        select_checkpoint(root, -1, True)
