"""--validation.*: the loss on data the model does not train on, forward only, leaving training as it was.

The runs train the MoE debug model of test_metrics_writers.py (its TensorBoard run is shared through
`cached_run`): its token counters are buffers every forward adds to and load balancing reads before
the optimizer step, so a validation forward that left them changed would change the next step's loss.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from helpers import cached_run, grad_norms, losses, read_metrics
from test_metrics_writers import TENSORBOARD

from graph_trainer import cli

VALIDATE_EVERY_STEP = ("--validation.enable", "--validation.freq", "1", "--validation.steps", "2")


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("validation") / "held_out.txt"
    path.write_text("\n\n".join(f"and it came to pass in the {i}th year that the graph was traced once" * 3 for i in range(40)))
    return path


def validated(mode: str, held_out: Path) -> Path:
    dump = ("--compile.dump_graphs",) if mode == "aot_fx_trace" else ()
    return cached_run((*TENSORBOARD, "--compile.mode", mode, *VALIDATE_EVERY_STEP, "--validation.dataset_path", str(held_out), *dump))


def test_training_is_bitwise_the_same_with_validation(held_out):
    plain = read_metrics(cached_run(TENSORBOARD))
    with_validation = read_metrics(validated("eager", held_out))
    assert [r["step"] for r in with_validation] == [1, 2, 3]
    assert losses(with_validation) == losses(plain)
    assert grad_norms(with_validation) == grad_norms(plain)
    assert [r["dropped_tokens"] for r in with_validation] == [r["dropped_tokens"] for r in plain]
    assert all("validation_loss" not in r for r in plain)


def test_validation_loss_is_bitwise_the_same_eager_and_traced(held_out):
    eager = read_metrics(validated("eager", held_out))
    traced_folder = validated("aot_fx_trace", held_out)
    traced = read_metrics(traced_folder)
    assert [r["validation_loss"] for r in traced] == [r["validation_loss"] for r in eager]
    assert [r["validation_perplexity"] for r in eager] == [math.exp(r["validation_loss"]) for r in eager]
    assert losses(traced) == losses(eager)
    # The model learns: the held-out loss falls after each update (and is not the training loss).
    values = [r["validation_loss"] for r in eager]
    assert values == sorted(values, reverse=True) and len(set(values)) == 3
    assert values != losses(eager)


def test_traced_validation_is_a_forward_graph(held_out):
    graphs = validated("aot_fx_trace", held_out) / "graphs"
    train_step = (graphs / "00_traced.py").read_text()
    forward = (graphs / "validation" / "00_traced.py").read_text()
    assert "_backward" in train_step
    assert "_backward" not in forward and "embedding" in forward


def test_tensorboard_holds_the_validation_figures(held_out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = validated("eager", held_out)
    records = read_metrics(folder)
    events = EventAccumulator(str(folder / "tb"))
    events.Reload()
    for tag in ("validation_loss", "validation_perplexity"):
        # TensorBoard stores scalars as float32.
        assert [(s.step, s.value) for s in events.Scalars(tag)] == [(r["step"], float(np.float32(r[tag]))) for r in records], tag


def test_held_out_documents_are_never_trained_on(tmp_path):
    """--validation.split: the last share of the documents goes to the validation loader only. The
    held-out documents are written in words no training document uses, so their token ids tell them apart."""
    from graph_trainer.config import parse_args
    from graph_trainer.data import build_tokenizer
    from graph_trainer.trainer import GraphTrainer

    trained = [f"in the beginning the word was with the graph, verse {'one two three'.split()[i % 3]}" for i in range(30)]
    held = ["zebra quartz jukebox xylophone" for _ in range(10)]
    data = tmp_path / "docs.txt"
    data.write_text("\n\n".join(trained + held))
    tokenizer = build_tokenizer(None)
    ids = lambda docs: {t for d in docs for t in tokenizer.encode(d)}  # noqa: E731
    held_only = ids(held) - ids(trained)
    assert held_only, "the held-out words must have tokens of their own"

    cfg = parse_args(["--job.dump_folder", str(tmp_path / "run"), "--training.dataset_path", str(data), "--training.seq_len", "16",
                      "--training.batch_size", "2", "--model.n_layers", "1", "--compile.mode", "eager",
                      "--validation.enable", "--validation.split", "0.25"])
    trainer = GraphTrainer(cfg)
    try:
        def epoch_tokens(loader) -> set[int]:
            seen: set[int] = set()
            while loader.state_dict()["epoch"] == 0:
                inputs, labels = loader.next_batch()
                seen |= set(inputs.flatten().tolist()) | set(labels.flatten().tolist())
            return seen

        assert not epoch_tokens(trainer.loader) & held_only
        assert held_only <= epoch_tokens(trainer.validator.loader)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("argv, line", [
    (["--validation.enable"], "--validation.enable needs data the model does not train on: --validation.dataset_path FILE, "
                              "or --validation.split 0.1 to hold out a share of the training documents"),
    (["--validation.enable", "--validation.dataset_path", "missing.txt"],
     "--validation.dataset_path: data path missing.txt does not exist; pass an existing .txt/.jsonl/.parquet/.txt.gz/.jsonl.gz "
     "file or a folder of them"),
    (["--validation.split", "1"], "validation.split is the share of the training documents held out, in [0, 1); got 1.0"),
    (["--validation.enable", "--validation.split", "0.1", "--validation.steps", "0"], "validation.steps must be >= 1, got 0"),
    (["--validation.enable", "--validation.split", "0.1", "--training.random_tokens"],
     "--validation.split holds out documents of the training data, and --training.random_tokens reads none: drop one of them "
     "(random tokens can validate on --validation.dataset_path)"),
])
def test_bad_validation_flags_exit_2_with_one_line(argv, line, tmp_path, monkeypatch, capsys):
    def tripwire(cfg):
        raise AssertionError("validation let a bad --validation flag through to training")

    monkeypatch.setattr("graph_trainer.trainer.run", tripwire)
    monkeypatch.chdir(tmp_path)
    code = cli.main(["train", "--job.dump_folder", str(tmp_path / "run"), *argv])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"graph-trainer: error: {line}"]
