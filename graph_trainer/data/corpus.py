"""Raw text documents from the shipped corpus or from user files, read lazily: `read_documents` names
them, iterating streams them file by file, so a corpus larger than memory never has to fit in it."""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from graph_trainer.config import ConfigError

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
SHIPPED_CORPUS = ASSETS_DIR / "corpus.txt.gz"

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet", ".txt.gz", ".jsonl.gz")
FORMATS = ".txt (documents separated by blank lines), .jsonl (a 'text' field per line), .parquet (a 'text' column)"


class DataError(ConfigError):
    """Data that cannot be read; the message names the file and the fix (one line, exit 2)."""


@dataclass(frozen=True)
class Documents(Sequence):
    """The documents of `files`, in order, from the `start`-th to before the `stop`-th (None: the end).

    Iterating streams them; a slice is another view of the same files (`TokenLoader` maps it onto the
    token file of the whole corpus); `len` and an index stream the files up to where they need."""

    files: tuple[Path, ...]
    label: str
    start: int = 0
    stop: int | None = None

    def __iter__(self) -> Iterator[str]:
        for i, (doc, _) in enumerate(self.stream()):
            if self.stop is not None and i >= self.stop:
                return
            if i >= self.start:
                yield doc

    def stream(self) -> Iterator[tuple[str, int]]:
        """Every document of the files (ignoring the view) with the bytes read so far, for progress."""
        done = 0
        for f in self.files:
            size = f.stat().st_size
            for doc, position in _read_file(f):
                yield doc, done + position
            done += size

    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def __len__(self) -> int:
        total = sum(1 for _ in self.stream())
        stop = total if self.stop is None else min(self.stop, total)
        return max(0, stop - self.start)

    def __getitem__(self, index):
        if isinstance(index, slice):
            if index.step not in (None, 1):
                raise ValueError("documents can be sliced with step 1 only")
            n = len(self) if any(i is not None and i < 0 for i in (index.start, index.stop)) else None
            lo, hi = index.start or 0, index.stop
            if lo < 0:
                lo += n
            if hi is not None and hi < 0:
                hi += n
            start = self.start + max(lo, 0)
            stop = self.stop if hi is None else self.start + max(hi, 0)
            if self.stop is not None and stop is not None:
                stop = min(stop, self.stop)
            return Documents(self.files, self.label, start, stop)
        if index < 0:
            index += len(self)
        for i, doc in enumerate(self):
            if i == index:
                return doc
        raise IndexError(f"document {index} of {self.label} does not exist")


def data_files(path: str | None) -> tuple[Path, ...]:
    """The files a data path reads: the file itself, or a folder's supported files sorted by name
    (other files there, e.g. a README or a licence, are ignored). Raises DataError naming the fix."""
    if path is None:
        return (SHIPPED_CORPUS,)
    p = Path(path)
    if not p.exists():
        raise DataError(f"data path {path} does not exist; pass an existing {'/'.join(SUPPORTED_SUFFIXES)} file or a folder of them")
    if p.is_dir():
        files = tuple(sorted(f for f in p.iterdir() if f.is_file() and _suffix(f) in SUPPORTED_SUFFIXES))
        if not files:
            raise DataError(f"data folder {path} holds no file ending in {', '.join(SUPPORTED_SUFFIXES)}; "
                            f"put {FORMATS} files in it")
        return files
    if _suffix(p) not in SUPPORTED_SUFFIXES:
        hint = "; a JSON file must become JSON Lines: one object with a 'text' field per line, in a .jsonl file" \
            if _suffix(p) in (".json", ".json.gz") else ""
        raise DataError(f"data file {path} is not a supported format{hint}; use {FORMATS}")
    return (p,)


def read_documents(path: str | None) -> Documents:
    """The documents stored at ``path``, in file order.

    ``None`` reads the shipped corpus (one King James Bible chapter per document). A file may be
    ``.txt`` (documents separated by blank lines), ``.jsonl`` (a ``text`` field per line), either of
    those gzip-compressed, or ``.parquet`` (a ``text`` column); a folder reads every such file in it.
    """
    files = data_files(path)
    return Documents(files, "the shipped corpus" if path is None else str(path))


def check_readable(files: Sequence[Path]) -> None:
    """What can be told of each file from its start: it opens in its format and holds a document
    there. Raises DataError naming the fix; a fault further in is found when the file is tokenized."""
    for f in files:
        if f.stat().st_size == 0:
            raise DataError(f"data file {f} is empty; remove it or put documents in it")
        if next(iter(_read_file(f)), None) is None:
            raise DataError(f"data file {f} holds no document; remove it or put documents in it")


def _suffix(path: Path) -> str:
    suffixes = path.suffixes
    if len(suffixes) >= 2 and suffixes[-1] == ".gz":
        return "".join(suffixes[-2:])
    return path.suffix


def _open_text(path: Path) -> tuple[IO[str], IO[bytes]]:
    """The file as text (universal newlines, UTF-8) and the raw file under it, whose position is
    the progress through it in bytes on disk."""
    raw = open(path, "rb")
    inner = gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw
    return io.TextIOWrapper(inner, encoding="utf-8"), raw


def _read_file(path: Path) -> Iterator[tuple[str, int]]:
    """(document, bytes of the file read) pairs."""
    suffix = _suffix(path)
    try:
        if suffix in (".txt", ".txt.gz"):
            yield from _read_txt(path)
        elif suffix in (".jsonl", ".jsonl.gz"):
            yield from _read_jsonl(path)
        else:
            yield from _read_parquet(path)
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None
    except PermissionError:
        raise DataError(f"data file {path} is not readable (permission denied); make it readable, e.g. chmod a+r") from None
    except (gzip.BadGzipFile, EOFError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise DataError(f"data file {path} cannot be read ({e}); replace it with an intact {suffix} file") from None


def _is_blank(line: str) -> bool:
    return line.strip(" \t") == ""


def _read_txt(path: Path) -> Iterator[tuple[str, int]]:
    """Documents are runs of lines between blank lines (empty or spaces and tabs only), stripped."""
    text, raw = _open_text(path)
    with text:
        lines: list[str] = []
        for line in text:
            line = line.rstrip("\n")
            if _is_blank(line):
                doc = "\n".join(lines).strip()
                lines = []
                if doc:
                    yield doc, raw.tell()
            else:
                lines.append(line)
        doc = "\n".join(lines).strip()
        if doc:
            yield doc, raw.tell()


def _read_jsonl(path: Path) -> Iterator[tuple[str, int]]:
    text, raw = _open_text(path)
    with text:
        for lineno, line in enumerate(text, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}); a .jsonl file holds one JSON object per line") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f"{path}:{lineno}: expected an object with a string field 'text', e.g. {{\"text\": \"...\"}}")
            yield record["text"], raw.tell()


def _read_parquet(path: Path) -> Iterator[tuple[str, int]]:
    # pyarrow is only needed for parquet input, so the import stays local.
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        data = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"data file {path} is not a readable Parquet file ({str(e).strip().splitlines()[0]}); "
                        "write it again, e.g. with pyarrow.parquet.write_table") from None
    if "text" not in data.schema_arrow.names:
        raise DataError(f"data file {path} has no 'text' column (columns: {', '.join(data.schema_arrow.names)}); name the text column 'text'")
    size, groups = path.stat().st_size, max(data.num_row_groups, 1)
    for group in range(data.num_row_groups):
        texts = data.read_row_group(group, columns=["text"]).column("text").to_pylist()
        if not all(isinstance(t, str) for t in texts):
            raise DataError(f"data file {path}: column 'text' holds null or non-string values; drop those rows")
        for t in texts:
            yield t, size * (group + 1) // groups
