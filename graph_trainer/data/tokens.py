"""The token file: a corpus tokenized once into a flat array on disk that every rank memory-maps.

Every document becomes ``BOS + tokens + separator`` (no BOS when the tokenizer has none; the separator
is `document_separator`'s: EOS, else SEP, else nothing), concatenated in document order. Beside the
tokens, the end offset of every document (int64), so a range of documents (a held-out share) is a
range of the one file.

The files live in `.graph-trainer-tokens/` beside the data (inside a data folder), or in the user's
cache folder (``$XDG_CACHE_HOME/graph-trainer/tokens``) for the shipped corpus and for data whose folder
is not writable. Their name holds a key of the data's and the tokenizer's content, so an edited file
or another tokenizer makes a new token file. One process writes it (whoever holds the file lock; the
others wait on the lock) into a temporary name and renames it into place, metadata last: a token file
whose metadata exists is complete.

The tokens are read through `torch.from_file` (a private, copy-on-write mapping): a rank's memory
holds only the pages its batches touch, whatever the corpus size.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from itertools import chain
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from graph_trainer.data.corpus import SHIPPED_CORPUS, Documents
from graph_trainer.data.tokenizer import document_separator

logger = logging.getLogger("graph_trainer")

CACHE_FOLDER = ".graph-trainer-tokens"
FORMAT_VERSION = 1
_CHUNK_CHARS = 8 * 2**20
"""Text encoded per batch call: the Rust tokenizer spreads a batch over all cores, and a bounded
batch bounds the memory of tokenizing (about 20 bytes per token while a batch is encoded)."""
_PROGRESS_EVERY_S = 5.0
_FIRST_RANK_GRACE_S = 10.0


def token_dtype(tokenizer) -> np.dtype:
    """int16 halves the bytes of int32 and covers vocabularies up to 32768 ids."""
    return np.dtype(np.int16 if tokenizer.get_vocab_size() <= 2**15 else np.int32)


def encode_documents(documents: Iterable[str], tokenizer) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, per-document token counts) of successive batches of documents, in order."""
    batch: list[str] = []
    chars = 0
    for doc in documents:
        batch.append(doc)
        chars += len(doc)
        if chars >= _CHUNK_CHARS:
            yield _encode(batch, tokenizer)
            batch, chars = [], 0
    if batch:
        yield _encode(batch, tokenizer)


def _encode(docs: list[str], tokenizer) -> tuple[np.ndarray, np.ndarray]:
    prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    separator = document_separator(tokenizer)
    suffix = [] if separator is None else [separator]
    if isinstance(tokenizer, HuggingFaceTokenizer):
        # The wrapper's encode() takes one string at a time; the Rust tokenizer's batch call spreads
        # documents over all cores. Its post-processor's special tokens (e.g. WordPiece's [CLS] ...
        # [SEP]) are left out: the stream's structure is the one rule above, for every tokenizer family.
        ids = [enc.ids for enc in tokenizer.tokenizer.encode_batch(docs, add_special_tokens=False)]
    else:
        ids = [tokenizer.encode(doc) for doc in docs]
    lengths = np.fromiter((len(prefix) + len(i) + len(suffix) for i in ids), dtype=np.int64, count=len(ids))
    pieces = chain.from_iterable((prefix, i, suffix) for i in ids)
    return np.fromiter(chain.from_iterable(pieces), dtype=token_dtype(tokenizer), count=int(lengths.sum())), lengths


def tokenize_in_memory(documents: Iterable[str], tokenizer) -> torch.Tensor:
    """The token stream of a few documents given as strings (no file behind them to key a cache on)."""
    chunks = [tokens for tokens, _ in encode_documents(documents, tokenizer)]
    return torch.from_numpy(np.concatenate(chunks) if chunks else np.zeros(0, token_dtype(tokenizer)))


def _tokenizer_key(tokenizer) -> str:
    """What decides the token stream: the tokenizer's full definition and the ids wrapped around documents."""
    return f"{tokenizer.tokenizer.to_str()}\n{tokenizer.bos_id}\n{document_separator(tokenizer)}\n{tokenizer.get_vocab_size()}"


def cache_key(documents: Documents, tokenizer) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"graph-trainer tokens v{FORMAT_VERSION}\n".encode())
    h.update(_tokenizer_key(tokenizer).encode())
    for f in documents.files:
        h.update(f"\n{f.name}\n{f.stat().st_size}\n".encode())
        with open(f, "rb") as stream:
            while block := stream.read(2**24):
                h.update(block)
    return h.hexdigest()


def cache_folder(documents: Documents) -> Path:
    """Beside the data when its folder is writable, else the user's cache folder."""
    first = documents.files[0]
    home = first.parent
    if first != SHIPPED_CORPUS and os.access(home, os.W_OK | os.X_OK):
        return home / CACHE_FOLDER
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "graph-trainer" / "tokens"


class TokenFile:
    """The token file of one corpus and tokenizer: its paths, and the arrays once written."""

    def __init__(self, documents: Documents, tokenizer):
        self.documents = Documents(documents.files, documents.label)
        self.tokenizer = tokenizer
        stem = documents.files[0].name.split(".")[0] if len(documents.files) == 1 else documents.files[0].parent.name
        self.base = cache_folder(documents) / f"{stem}-{cache_key(documents, tokenizer)}"
        self.tokens_path = self.base.with_suffix(".tokens")
        self.offsets_path = self.base.with_suffix(".docs")
        self.meta_path = self.base.with_suffix(".json")

    def complete(self) -> bool:
        return self.meta_path.is_file()

    def ensure(self) -> None:
        """Write the token file unless it exists. Whoever holds the file lock writes, the others wait
        on it; a node's first rank (whose log is shown) goes first, the others give it a grace period."""
        if self.complete():
            return
        self.base.parent.mkdir(parents=True, exist_ok=True)
        first = os.environ.get("LOCAL_RANK", "0") == "0"
        deadline = time.monotonic() + (0 if first else _FIRST_RANK_GRACE_S)
        with open(self.base.with_suffix(".lock"), "w") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                if self.complete() or time.monotonic() >= deadline:
                    break
                fcntl.flock(lock, fcntl.LOCK_UN)
                time.sleep(0.1)
            if not self.complete():
                started = time.perf_counter()
                self.write(encode_documents(self._with_progress(), self.tokenizer))
                meta = json.loads(self.meta_path.read_text())
                logger.info(f"tokenized {self.documents.label}: {meta['num_tokens']:,} tokens of {meta['num_documents']:,} documents "
                            f"in {time.perf_counter() - started:.1f} s")

    def write(self, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        """Store (tokens, per-document lengths) chunks as this corpus's token file, atomically."""
        tmp = f".tmp-{os.getpid()}"
        tokens_tmp, offsets_tmp, meta_tmp = (Path(str(p) + tmp) for p in (self.tokens_path, self.offsets_path, self.meta_path))
        num_tokens = num_docs = 0
        try:
            with open(tokens_tmp, "wb") as tokens_out, open(offsets_tmp, "wb") as offsets_out:
                for tokens, lengths in chunks:
                    tokens_out.write(tokens.astype(token_dtype(self.tokenizer), copy=False).tobytes())
                    offsets_out.write((num_tokens + np.cumsum(lengths)).astype(np.int64).tobytes())
                    num_tokens += int(lengths.sum())
                    num_docs += len(lengths)
            meta = {"format": FORMAT_VERSION, "dtype": token_dtype(self.tokenizer).name, "num_tokens": num_tokens,
                    "num_documents": num_docs, "data": [str(f) for f in self.documents.files]}
            meta_tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tokens_tmp, self.tokens_path)
            os.replace(offsets_tmp, self.offsets_path)
            os.replace(meta_tmp, self.meta_path)
        finally:
            for p in (tokens_tmp, offsets_tmp, meta_tmp):
                p.unlink(missing_ok=True)

    def _with_progress(self) -> Iterator[str]:
        total = max(self.documents.total_bytes(), 1)
        started = last = time.perf_counter()
        logger.info(f"tokenizing {self.documents.label} ({total / 2**20:,.1f} MiB): 0% read; into {self.tokens_path}, once for every later run")
        count = 0
        for doc, done in self.documents.stream():
            count += 1
            yield doc
            now = time.perf_counter()
            if now - last >= _PROGRESS_EVERY_S:
                last = now
                logger.info(f"tokenizing {self.documents.label}: {100 * done / total:.0f}% read ({count:,} documents, {now - started:.0f} s)")

    def read(self) -> tuple[torch.Tensor, np.ndarray]:
        """(tokens, document end offsets), both memory-mapped."""
        meta = json.loads(self.meta_path.read_text())
        dtype = {"int16": torch.int16, "int32": torch.int32}[meta["dtype"]]
        n = meta["num_tokens"]
        tokens = torch.from_file(str(self.tokens_path), shared=False, size=n, dtype=dtype) if n else torch.zeros(0, dtype=dtype)
        offsets = np.memmap(self.offsets_path, dtype=np.int64, mode="r") if meta["num_documents"] else np.zeros(0, np.int64)
        return tokens, offsets


def token_stream(documents: Iterable[str], tokenizer) -> torch.Tensor:
    """The 1-D token stream of `documents`: memory-mapped from the corpus's token file (written on the
    first call) for documents read from files, else tokenized in memory."""
    if not isinstance(documents, Documents) or not isinstance(tokenizer, HuggingFaceTokenizer):
        # a list of strings has no files to key a token file on, another tokenizer no definition
        return tokenize_in_memory(documents, tokenizer)
    token_file = TokenFile(documents, tokenizer)
    token_file.ensure()
    tokens, offsets = token_file.read()

    def end_of(docs: int) -> int:
        return 0 if docs == 0 else int(offsets[min(docs, len(offsets)) - 1])

    start = end_of(documents.start)
    stop = len(tokens) if documents.stop is None else end_of(documents.stop)
    return tokens[start:max(start, stop)]
