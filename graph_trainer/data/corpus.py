"""Reading raw text documents from the shipped corpus or from user files."""

import gzip
import json
import re
from pathlib import Path
from typing import IO

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
SHIPPED_CORPUS = ASSETS_DIR / "corpus.txt.gz"

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet", ".txt.gz", ".jsonl.gz")

# A blank line is empty or whitespace-only; runs of them count as one separator.
_BLANK_LINES = re.compile(r"\n[ \t]*(?:\n[ \t]*)+")


def read_documents(path: str | None) -> list[str]:
    """Return the documents stored at ``path``, in file order.

    ``None`` reads the shipped corpus (one King James Bible chapter per
    document). A file may be ``.txt`` (documents separated by blank lines),
    ``.jsonl`` (a ``text`` field per line), either of those gzip-compressed, or
    ``.parquet`` (a ``text`` column). A directory reads every supported file in
    it, sorted by name; other files there are ignored so that dataset folders
    with READMEs or licences can be pointed at directly.
    """
    if path is None:
        return _read_file(SHIPPED_CORPUS)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data path does not exist: {path}")
    if p.is_dir():
        files = sorted(
            f for f in p.iterdir() if f.is_file() and _suffix(f) in SUPPORTED_SUFFIXES
        )
        if not files:
            raise ValueError(
                f"directory {path} holds no file ending in {', '.join(SUPPORTED_SUFFIXES)}"
            )
        return [doc for f in files for doc in _read_file(f)]
    return _read_file(p)


def _suffix(path: Path) -> str:
    suffixes = path.suffixes
    if len(suffixes) >= 2 and suffixes[-1] == ".gz":
        return "".join(suffixes[-2:])
    return path.suffix


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _read_file(path: Path) -> list[str]:
    suffix = _suffix(path)
    if suffix in (".txt", ".txt.gz"):
        return _read_txt(path)
    if suffix in (".jsonl", ".jsonl.gz"):
        return _read_jsonl(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise ValueError(
        f"unsupported data file {path}: expected one of {', '.join(SUPPORTED_SUFFIXES)}"
    )


def _read_txt(path: Path) -> list[str]:
    with _open_text(path) as f:
        text = f.read()
    return [doc.strip() for doc in _BLANK_LINES.split(text) if doc.strip()]


def _read_jsonl(path: Path) -> list[str]:
    docs = []
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string field 'text'")
            docs.append(record["text"])
    return docs


def _read_parquet(path: Path) -> list[str]:
    # pyarrow is only needed for parquet input, so the import stays local.
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    if "text" not in schema.names:
        raise ValueError(f"{path}: no 'text' column (columns: {', '.join(schema.names)})")
    texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    if not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{path}: column 'text' holds null or non-string values")
    return texts
