import gzip
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from graph_trainer.data import DataError, TokenLoader, build_tokenizer, read_documents
from graph_trainer.data.corpus import ASSETS_DIR, SHIPPED_CORPUS
from graph_trainer.data.tokens import CACHE_FOLDER, TokenFile, tokenize_in_memory


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(None)


@pytest.fixture(scope="module")
def corpus():
    return read_documents(None)


@pytest.fixture(scope="module")
def small_docs(corpus):
    # Small enough that a few batches wrap around the stream more than once.
    return list(corpus[:6])


class _PlainTokenizer:
    """Exposes only the generic encode interface, hiding the batch fast path."""

    def __init__(self, inner):
        self.inner = inner
        self.bos_id = inner.bos_id
        self.eos_id = inner.eos_id

    def encode(self, text, add_bos=False, add_eos=False):
        return self.inner.encode(text, add_bos=add_bos, add_eos=add_eos)

    def get_vocab_size(self):
        return self.inner.get_vocab_size()


def _reference_stream(docs, tokenizer):
    return [t for d in docs for t in tokenizer.encode(d, add_bos=True, add_eos=True)]


# --- shipped corpus -------------------------------------------------------


def test_shipped_corpus_is_small_compressed_english(corpus):
    assert SHIPPED_CORPUS.is_file()
    assert SHIPPED_CORPUS.stat().st_size < 20 * 2**20
    with gzip.open(SHIPPED_CORPUS, "rt", encoding="utf-8") as f:
        assert f.read(9) == "Genesis 1"
    # One document per chapter of the King James Bible.
    assert len(corpus) == 1189
    assert corpus[0].startswith("Genesis 1\nIn the beginning God created the heaven and the earth.")
    assert corpus[-1].startswith("Revelation 22\n")
    words = Counter(w.lower().strip(".,;:?!") for w in " ".join(corpus[:50]).split())
    assert {w for w, _ in words.most_common(10)} >= {"the", "and", "of"}


# --- tokenizer ------------------------------------------------------------


def test_shipped_tokenizer_vocab_and_special_tokens(tokenizer):
    assert tokenizer.get_vocab_size() == 2048
    assert tokenizer.bos_id is not None and tokenizer.eos_id is not None
    assert tokenizer.bos_id != tokenizer.eos_id
    assert tokenizer.token_to_id("<|begin_of_text|>") == tokenizer.bos_id
    assert tokenizer.token_to_id("<|end_of_text|>") == tokenizer.eos_id


def test_tokenizer_round_trips_text(tokenizer):
    sentence = "And God said, Let there be light: and there was light."
    ids = tokenizer.encode(sentence, add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.bos_id not in ids[1:-1] and tokenizer.eos_id not in ids[1:-1]
    assert tokenizer.decode(ids[1:-1]) == sentence
    assert tokenizer.encode(sentence) == ids[1:-1]
    # Byte-level: text unlike the corpus must still round-trip exactly.
    odd = "naïve café — 東京 😀\ttabs\nand  spaces"
    assert tokenizer.decode(tokenizer.encode(odd)) == odd


def test_build_tokenizer_from_file_and_directory(tmp_path, tokenizer):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS_DIR / name, tmp_path / name)
    text = "In the beginning"
    for path in (tmp_path, tmp_path / "tokenizer.json"):
        loaded = build_tokenizer(str(path))
        assert loaded.get_vocab_size() == 2048
        assert loaded.bos_id == tokenizer.bos_id and loaded.eos_id == tokenizer.eos_id
        assert loaded.encode(text, add_bos=True) == tokenizer.encode(text, add_bos=True)


# --- read_documents -------------------------------------------------------


def test_read_txt_splits_on_blank_lines(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"first doc\nline two\r\n\r\n\n  \nsecond doc\n\n\nthird\n\n")
    assert list(read_documents(str(path))) == ["first doc\nline two", "second doc", "third"]


def test_read_gzipped_txt(tmp_path):
    path = tmp_path / "a.txt.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("one\n\ntwo\n")
    assert list(read_documents(str(path))) == ["one", "two"]


def test_read_jsonl(tmp_path):
    path = tmp_path / "a.jsonl"
    rows = [{"text": "alpha\n\nstill alpha", "id": 1}, {"text": "beta"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert list(read_documents(str(path))) == ["alpha\n\nstill alpha", "beta"]
    path.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match="a.jsonl:1: expected an object with a string field 'text'"):
        list(read_documents(str(path)))


def test_read_parquet(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["p1", "p2 ü"], "n": [1, 2]}), path)
    assert list(read_documents(str(path))) == ["p1", "p2 ü"]
    pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(DataError, match="has no 'text' column"):
        list(read_documents(str(path)))


def test_read_directory_in_name_order(tmp_path):
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "from b"}) + "\n")
    (tmp_path / "a.txt").write_text("from a 1\n\nfrom a 2\n")
    pq.write_table(pa.table({"text": ["from c"]}), tmp_path / "c.parquet")
    (tmp_path / "README.md").write_text("ignored\n")
    assert list(read_documents(str(tmp_path))) == ["from a 1", "from a 2", "from b", "from c"]


def test_read_documents_bad_paths(tmp_path):
    with pytest.raises(DataError, match="missing.txt does not exist"):
        read_documents(str(tmp_path / "missing.txt"))
    bad = tmp_path / "data.csv"
    bad.write_text("text\nx\n")
    with pytest.raises(DataError, match="data.csv is not a supported format"):
        read_documents(str(bad))
    with pytest.raises(DataError, match="holds no file ending in"):
        read_documents(str(tmp_path))


# --- TokenLoader ----------------------------------------------------------


def test_full_corpus_loader_is_compact(corpus, tokenizer):
    loader = TokenLoader(
        corpus, tokenizer, seq_len=2048, local_batch_size=2, dp_rank=0, dp_degree=1
    )
    assert loader.tokens.dtype == torch.int16
    assert loader.num_tokens > 1_000_000
    inputs, labels = loader.next_batch()
    assert inputs.shape == labels.shape == (2, 2048)
    assert inputs.dtype == labels.dtype == torch.int64
    assert inputs[0, 0].item() == tokenizer.bos_id


def test_batches_follow_the_token_stream(small_docs, tokenizer):
    seq_len, batch = 32, 3
    stream = torch.tensor(_reference_stream(small_docs, tokenizer))
    loader = TokenLoader(small_docs, tokenizer, seq_len, batch, dp_rank=0, dp_degree=1)
    n = loader.samples_per_epoch
    assert n == len(stream) // (seq_len + 1)
    for k in range(n // batch + 2):
        inputs, labels = loader.next_batch()
        for row in range(batch):
            i = (k * batch + row) % n
            sample = stream[i * (seq_len + 1) : (i + 1) * (seq_len + 1)]
            assert torch.equal(inputs[row], sample[:-1])
            assert torch.equal(labels[row], sample[1:])
    assert loader.epoch >= 1


def test_batch_encoding_matches_per_document_encode(small_docs, tokenizer):
    fast = TokenLoader(small_docs, tokenizer, 16, 2, 0, 1)
    plain = TokenLoader(small_docs, _PlainTokenizer(tokenizer), 16, 2, 0, 1)
    assert torch.equal(fast.tokens, plain.tokens)


@pytest.mark.parametrize("dp_degree", [2, 4])
def test_ranks_concatenate_to_single_rank_batch(small_docs, tokenizer, dp_degree):
    seq_len, local = 24, 3
    single = TokenLoader(small_docs, tokenizer, seq_len, local * dp_degree, 0, 1)
    ranks = [
        TokenLoader(small_docs, tokenizer, seq_len, local, r, dp_degree) for r in range(dp_degree)
    ]
    # Enough steps to cross the end of the stream at least once.
    steps = single.samples_per_epoch // (local * dp_degree) + 3
    for _ in range(steps):
        want_inputs, want_labels = single.next_batch()
        got = [loader.next_batch() for loader in ranks]
        assert torch.equal(torch.cat([g[0] for g in got]), want_inputs)
        assert torch.equal(torch.cat([g[1] for g in got]), want_labels)


def test_resume_gives_the_same_next_batches(small_docs, tokenizer):
    def make(rank):
        return TokenLoader(small_docs, tokenizer, 20, 2, rank, 2)

    # The last count crosses into the second epoch (4 samples per global batch).
    for consumed in (0, 3, make(0).samples_per_epoch // 4 + 1):
        original = make(1)
        for _ in range(consumed):
            original.next_batch()
        state = original.state_dict()
        resumed = make(1)
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state
        for _ in range(5):
            a, b = original.next_batch(), resumed.next_batch()
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert state["epoch"] >= 1


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("seq_len", dict(seq_len=21)),
        ("local_batch_size", dict(local_batch_size=3)),
        ("dp_degree", dict(dp_degree=4)),
        ("num_tokens", dict(docs_slice=5)),
    ],
)
def test_incompatible_state_raises(small_docs, tokenizer, field, kwargs):
    def make(seq_len=20, local_batch_size=2, dp_degree=2, docs_slice=6):
        docs = small_docs[:docs_slice]
        return TokenLoader(docs, tokenizer, seq_len, local_batch_size, 0, dp_degree)

    state = make().state_dict()
    with pytest.raises(ValueError, match=f"loader state does not match this loader: {field} is .* in the state but .* here"):
        make(**kwargs).load_state_dict(state)


def test_loader_rejects_bad_arguments(small_docs, tokenizer):
    with pytest.raises(ValueError, match=re.escape("dp_rank 2 is outside [0, 2)")):
        TokenLoader(small_docs, tokenizer, 16, 2, dp_rank=2, dp_degree=2)
    with pytest.raises(DataError, match="fewer than one sample of seq_len \\+ 1 = 1001; give more data or a smaller --training.seq_len"):
        TokenLoader(["tiny"], tokenizer, 1000, 1, 0, 1)
    with pytest.raises(ValueError, match="loader state lacks epoch, sample_in_epoch, local_batch_size, dp_degree, num_tokens"):
        TokenLoader(small_docs, tokenizer, 16, 2, 0, 1).load_state_dict({"seq_len": 16})


# --- the token file ---------------------------------------------------------

# The shipped corpus's token stream and the default run's first three batches (8 x 256, one rank) as the
# loader that tokenized into Python lists made them: the token file must not change what the default run trains on.
SHIPPED_TOKENS = 1_161_152
SHIPPED_STREAM_SHA256 = "eefcbcd92ee610108df2f9a8bd89ebdf420be68bf39703f9f54168e83a0f3a03"
SHIPPED_FIRST_BATCHES_SHA256 = "103f58b0a5d547284d262b95f7d270a670f99b728bced85a8ec58bc70723f812"


def _sha256(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def test_shipped_default_run_reads_the_same_tokens_as_before(corpus, tokenizer):
    loader = TokenLoader(corpus, tokenizer, 256, 8, 0, 1)
    assert loader.num_tokens == SHIPPED_TOKENS
    assert _sha256(loader.tokens) == SHIPPED_STREAM_SHA256
    assert _sha256(*(t for _ in range(3) for t in loader.next_batch())) == SHIPPED_FIRST_BATCHES_SHA256


def test_token_file_is_written_once_beside_the_data_and_follows_its_content(tmp_path, tokenizer, caplog):
    data = tmp_path / "docs.jsonl"
    docs = [f"document {i}: " + "the quick brown fox " * (i % 7 + 1) for i in range(300)]
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    with caplog.at_level(logging.INFO, logger="graph_trainer"):
        first = TokenLoader(read_documents(str(data)), tokenizer, 16, 2, 0, 1)
    assert re.search(r"tokenizing .*docs\.jsonl .*: 0% read", caplog.text)
    assert re.search(r"tokenized .*docs\.jsonl: [\d,]+ tokens of 300 documents", caplog.text)
    written = sorted(p.name for p in (tmp_path / CACHE_FOLDER).glob("*.tokens"))
    assert len(written) == 1
    assert torch.equal(first.tokens, tokenize_in_memory(docs, tokenizer))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="graph_trainer"):
        again = TokenLoader(read_documents(str(data)), tokenizer, 16, 2, 0, 1)
    assert "tokeniz" not in caplog.text
    assert torch.equal(again.tokens, first.tokens)
    # A held-out share is a range of the same file: the token streams of the two parts, back to back.
    documents = read_documents(str(data))
    head, tail = documents[:250], documents[250:]
    assert (len(head), len(tail)) == (250, 50)
    assert torch.equal(TokenLoader(tail, tokenizer, 16, 2, 0, 1).tokens, tokenize_in_memory(docs[250:], tokenizer))
    assert torch.equal(torch.cat([TokenLoader(head, tokenizer, 16, 2, 0, 1).tokens, TokenLoader(tail, tokenizer, 16, 2, 0, 1).tokens]),
                       first.tokens)
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:100]))
    assert TokenLoader(read_documents(str(data)), tokenizer, 16, 2, 0, 1).num_tokens < first.num_tokens
    assert len(list((tmp_path / CACHE_FOLDER).glob("*.tokens"))) == 2


def _rss_anon() -> int:
    """Bytes of this process's anonymous memory: a memory-mapped file's pages are not counted."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1)) * 1024


def test_a_corpus_of_100m_tokens_is_read_in_memory_independent_of_its_size(tmp_path, tokenizer):
    """The token file is written directly (tokenizing 100M tokens would take minutes): token i is
    i mod 2039, so every sample's content is known. A loader holding the stream as Python ints, as
    before, needed ~174 bytes per token (17 GB here)."""
    data = tmp_path / "big.txt"
    data.write_text("a placeholder: the token file below stands for this data\n")
    documents = read_documents(str(data))
    modulus, chunk, chunks = 2039, 1 << 20, 100
    token_file = TokenFile(documents, tokenizer)
    token_file.base.parent.mkdir()

    def blocks():
        for c in range(chunks):
            yield (np.arange(c * chunk, (c + 1) * chunk) % modulus).astype(np.int16), np.array([chunk])

    token_file.write(blocks())
    num_tokens, seq_len, batch = chunks * chunk, 2048, 4
    before = _rss_anon()
    loader = TokenLoader(documents, tokenizer, seq_len, batch, 0, 1)
    assert loader.num_tokens == num_tokens > 100_000_000
    samples = loader.samples_per_epoch
    for position in (0, samples // 2, samples - batch):
        loader.load_state_dict({**loader.state_dict(), "epoch": 0, "sample_in_epoch": position})
        inputs, labels = loader.next_batch()
        first = position * (seq_len + 1)
        expected = (torch.arange(first, first + batch * (seq_len + 1)) % modulus).view(batch, seq_len + 1)
        assert torch.equal(inputs, expected[:, :-1]) and torch.equal(labels, expected[:, 1:])
    # Resume keeps the exact position: a new loader from the state gives the next batch.
    state = loader.state_dict()
    resumed = TokenLoader(read_documents(str(data)), tokenizer, seq_len, batch, 0, 1)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(), loader.next_batch()))
    # A few MB of batches and bookkeeping, against the file's 200 MB (and 17 GB before).
    assert _rss_anon() - before < 16 * 2**20


def _ensure_as(local_rank: int, path: str, writers) -> None:
    """One rank of a node building the token file (a forked process)."""
    os.environ["LOCAL_RANK"] = str(local_rank)
    token_file = TokenFile(read_documents(path), build_tokenizer(None))
    write = token_file.write

    def counted(chunks):
        writers.put(local_rank)
        write(chunks)

    token_file.write = counted
    token_file.ensure()


def test_one_process_writes_the_token_file_while_the_others_wait(tmp_path, corpus, tokenizer):
    data = tmp_path / "corpus.txt"
    docs = list(corpus[:300])
    data.write_text("\n\n".join(docs))
    context = multiprocessing.get_context("fork")
    writers = context.Queue()
    # the second rank starts first: it must leave the file to the node's first rank, whose log is shown
    ranks = [context.Process(target=_ensure_as, args=(r, str(data), writers)) for r in (1, 0)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=120)
    assert [p.exitcode for p in ranks] == [0, 0]
    assert writers.get(timeout=5) == 0 and writers.empty()
    loaded = TokenLoader(read_documents(str(data)), tokenizer, 16, 2, 0, 1)
    assert torch.equal(loaded.tokens, tokenize_in_memory(docs, tokenizer))
