"""Any Hugging Face tokenizer: BPE, WordPiece and Unigram tokenizers built here with the `tokenizers`
library, with and without BOS/EOS, under odd file names or in a folder with tokenizer_config.json,
each trained on for a few steps; the model's vocabulary follows the tokenizer and documents are
separated as the README states (BOS if any + text + EOS, else SEP, else nothing)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from graph_trainer import cli, trainer
from graph_trainer.models import VOCAB_MULTIPLE, get_spec, install_attention_masks, padded_vocab
from graph_trainer.config import parse_args
from graph_trainer.data import read_documents
from graph_trainer.passes.registry import run_teardowns

from helpers import child_env, launch, run_train

DOCS = read_documents(None)[:40]


def _bpe(special: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _wordpiece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(DOCS, trainers.WordPieceTrainer(vocab_size=500, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]"]))
    # What BERT's post-processor adds to every encoding; the token stream must not carry it.
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))]
    )
    return tok


def _unigram() -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(DOCS, trainers.UnigramTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"], unk_token="<unk>"))
    return tok


def _save(folder: Path, name: str, tok: Tokenizer, config: dict | None) -> Path:
    folder.mkdir(parents=True)
    tok.save(str(folder / name))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / name


# name: (build, file name, tokenizer_config.json or None, pass the folder?, BOS, separator)
FAMILIES = {
    "bpe_bos_eos_folder": (lambda: _bpe(["<s>", "</s>"]), "my-bpe.tok.json", {"bos_token": "<s>", "eos_token": "</s>"}, True, "<s>", "</s>"),
    "bpe_plain_file": (lambda: _bpe([]), "bpe_no_specials.json", None, False, None, None),
    "wordpiece_sep_folder": (_wordpiece, "vocab-wp.json", {"cls_token": "[CLS]", "sep_token": "[SEP]", "unk_token": "[UNK]"},
                             True, None, "[SEP]"),
    "unigram_eos_file": (_unigram, "spm.unigram", {"eos_token": "</s>", "unk_token": "<unk>"}, False, None, "</s>"),
}


def _train_with(path: Path, dump: Path, monkeypatch, *extra: str) -> tuple[trainer.GraphTrainer, list[dict]]:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    data = dump.parent / "docs.txt"
    data.write_text("\n\n".join(DOCS))
    cfg = parse_args(["--model.tokenizer_path", str(path), "--training.dataset_path", str(data), "--training.steps", "2",
                      "--training.seq_len", "64", "--training.batch_size", "2", "--model.n_layers", "2",
                      "--job.dump_folder", str(dump), "--metrics.progress_bar", "false", *extra])
    from graph_trainer.validate import validate

    validate(cfg)
    run = trainer.GraphTrainer(cfg)
    try:
        return run, run.train()
    finally:
        run_teardowns()
        dist.destroy_process_group()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_tokenizer_family_trains_with_its_vocabulary_and_separators(family, tmp_path, monkeypatch):
    build, name, config, pass_folder, bos, sep = FAMILIES[family]
    raw = build()
    file = _save(tmp_path / "tok", name, raw, config)
    run, records = _train_with(file.parent if pass_folder else file, tmp_path / "out", monkeypatch)

    vocab = padded_vocab(raw.get_vocab_size())
    assert vocab != 2048  # the flavor's: following the tokenizer must change it
    assert run.model.model_args.vocab_size == vocab
    assert run.model.tok_embeddings.weight.shape[0] == vocab
    assert run.model.output.weight.shape[0] == vocab
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)

    # The stream, built independently from the raw tokenizer: [BOS] text [separator] per document.
    prefix = [] if bos is None else [raw.token_to_id(bos)]
    suffix = [] if sep is None else [raw.token_to_id(sep)]
    expected = [t for doc in DOCS for t in (*prefix, *raw.encode(doc, add_special_tokens=False).ids, *suffix)]
    assert run.loader.tokens.tolist() == expected
    if family == "wordpiece_sep_folder":
        assert raw.token_to_id("[CLS]") not in expected


def test_config_token_missing_from_the_vocabulary_is_added_and_counted(tmp_path, monkeypatch):
    """A tokenizer_config.json naming an EOS the tokenizer lacks: Hugging Face adds it, so the tokenizer
    has one id more than the file and every document ends with the new id."""
    raw = _bpe([])
    file = _save(tmp_path / "tok", "tokenizer.json", raw, {"eos_token": "<|end|>"})
    run, _ = _train_with(file.parent, tmp_path / "out", monkeypatch)
    assert run.tokenizer.get_vocab_size() == raw.get_vocab_size() + 1
    eos = raw.get_vocab_size()
    assert run.loader.tokens.tolist().count(eos) == len(DOCS)


def test_vocabulary_is_padded_to_the_same_multiple_on_every_mesh(tmp_path):
    """401 ids become 512 rows on tp 1 and tp 2 alike; random tokens keep the flavor's 2048."""
    _save(tmp_path / "tok", "t.json", _bpe(["<s>"]), {"bos_token": "<s>", "eos_token": "<|new|>"})
    spec = get_spec("llama3")
    args = ["--model.tokenizer_path", str(tmp_path / "tok")]
    assert spec.job_args(parse_args(args)).vocab_size == 512
    assert spec.job_args(parse_args([*args, "--parallelism.tp", "2"])).vocab_size == 512
    assert spec.job_args(parse_args([*args, "--training.random_tokens"])).vocab_size == 2048


def test_every_tp_the_validator_allows_divides_the_vocabulary_multiple():
    """The validator lets a tp through when it divides the flavor's head counts; padding to
    VOCAB_MULTIPLE keeps the mesh out of the stored model only if each such tp divides it too."""
    from graph_trainer.models import model_names

    for name in model_names():
        for flavor, args in get_spec(name).flavors.items():
            heads = [args.n_heads] + ([args.n_kv_heads] if getattr(args, "n_kv_heads", None) else [])
            allowed = [tp for tp in range(1, args.n_heads + 1) if all(h % tp == 0 for h in heads)]
            assert all(VOCAB_MULTIPLE % tp == 0 for tp in allowed), (name, flavor, allowed)
            assert args.vocab_size % VOCAB_MULTIPLE == 0, (name, flavor, args.vocab_size)


def test_odd_vocabulary_trained_at_tp_1_exports_and_resumes_at_tp_2(tmp_path, monkeypatch):
    """A tokenizer whose size no tp divides: the checkpoint of a tp 1 run exports with its own vocabulary
    and resumes on a tp 2 mesh of 2 gloo ranks, which trains on from it."""
    raw = _bpe(["<s>"])
    ids = raw.get_vocab_size() + 1  # with the EOS the config adds
    assert ids % 2 == 1
    file = _save(tmp_path / "tok", "tokenizer.json", raw, {"bos_token": "<s>", "eos_token": "<|new|>"})
    dump = tmp_path / "out"
    _train_with(file.parent, dump, monkeypatch, "--checkpoint.enable", "--compile.mode", "eager")

    assert cli.main(["export", "--checkpoint", str(dump / "checkpoint" / "step-2"), "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == padded_vocab(ids)

    records = run_train(["--config", str(dump / "config.toml"), "--training.steps", "3", "--parallelism.dp_shard", "1",
                         "--parallelism.tp", "2"], dump, nproc=2)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert math.isfinite(records[-1]["loss"])


@torch.no_grad()
def test_without_a_separator_document_masks_are_causal_over_the_sequence():
    """No separator: documents are not marked, so a FlexAttention `block_causal` model masks causally
    over the whole sequence, whatever ids the tokens hold (1 is EOS for the shipped tokenizer)."""
    spec = get_spec("llama3")
    torch.manual_seed(0)
    flex, sdpa = (spec.model_cls(spec.args_for(flavor, 128)) for flavor in ("debugmodel_flex_attn", "debugmodel"))
    flex.init_weights()
    sdpa.load_state_dict(flex.state_dict())
    install_attention_masks(flex, None)
    tokens = torch.randint(2, 2048, (2, 128), generator=torch.Generator().manual_seed(0))
    tokens[:, 40] = 1
    torch.testing.assert_close(flex(tokens), sdpa(tokens), rtol=1e-4, atol=1e-4)


def _two_tokenizers(scratch: Path) -> None:
    _bpe([]).save(str(scratch / "a.json"))
    _unigram().save(str(scratch / "b.json"))


def _bad_config(scratch: Path) -> None:
    _bpe([]).save(str(scratch / "tokenizer.json"))
    (scratch / "tokenizer_config.json").write_text("{not json")


BAD = {
    "missing": (lambda s: None, "{scratch}/nope.json", "does not exist"),
    "folder_without_tokenizer": (lambda s: (s / "notes.txt").write_text("hi"), "{scratch}", "exactly one Hugging Face tokenizer file"),
    "folder_with_two": (_two_tokenizers, "{scratch}", "found: a.json, b.json"),
    "not_a_tokenizer": (lambda s: (s / "vocab.json").write_text('{"a": 0}'), "{scratch}/vocab.json",
                        "is not a Hugging Face tokenizer file"),
    "unreadable_config": (_bad_config, "{scratch}", "tokenizer_config.json cannot be read"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_unusable_tokenizer_path_is_one_line_exit_2(case, tmp_path, monkeypatch, capsys):
    setup, path, needle = BAD[case]
    setup(tmp_path)

    def tripwire(cfg):
        raise AssertionError("validation let an unusable tokenizer through to training")

    monkeypatch.setattr("graph_trainer.trainer.run", tripwire)
    code = cli.main(["train", "--model.tokenizer_path", path.format(scratch=tmp_path), "--job.dump_folder", str(tmp_path / "out")])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("graph-trainer: error: "), lines
    assert needle in lines[0], lines


def test_unusable_tokenizer_stops_a_rank_before_its_process_group(tmp_path):
    """One rank of a 2-rank job with no peer and no rendezvous: only validation can end it, with exit 2."""
    (tmp_path / "vocab.json").write_text('{"a": 0}')
    env = child_env(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1")
    proc = launch(["train", "--model.tokenizer_path", str(tmp_path / "vocab.json"), "--job.dump_folder", str(tmp_path / "out"),
                   "--parallelism.dp_shard", "2"], env=env, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert lines == [f"[rank 1] graph-trainer: error: model.tokenizer_path {tmp_path / 'vocab.json'} is not a Hugging Face "
                     f"tokenizer file ({_reason(tmp_path / 'vocab.json')}); save one with tokenizers' Tokenizer.save or "
                     f"transformers' save_pretrained"]


def _reason(path: Path) -> str:
    try:
        Tokenizer.from_file(str(path))
    except Exception as e:
        return str(e).strip().splitlines()[0]
    raise AssertionError(f"{path} loaded as a tokenizer")
