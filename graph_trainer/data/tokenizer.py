"""Loading any Hugging Face `tokenizers` tokenizer (BPE, WordPiece, Unigram, ...) through torchtitan's
wrapper, from a file of any name or a folder holding one."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any, Iterator

from tokenizers import Tokenizer
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from graph_trainer.data.corpus import ASSETS_DIR

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


class TokenizerError(ValueError):
    """A tokenizer path that cannot be used; the message names the fix."""


class FileTokenizer(HuggingFaceTokenizer):
    """torchtitan's wrapper around one tokenizer file, whatever its name.

    BOS/EOS (and the SEP token) are the ones `tokenizer_config.json` beside the file names; without
    that file the tokenizer has none. Tokens the config names that the vocabulary lacks are added to
    it, as Hugging Face does, so they count in `get_vocab_size()`."""

    def __init__(self, tokenizer_file: Path):
        self.tokenizer_file = tokenizer_file
        with _folder_for(tokenizer_file) as folder:
            super().__init__(str(folder))
        sep = _config_token(self.config, "sep_token")
        self.sep_id = self.tokenizer.token_to_id(sep) if sep else None


@contextlib.contextmanager
def _folder_for(file: Path) -> Iterator[Path]:
    """A folder where torchtitan's wrapper, which reads `tokenizer.json` and `tokenizer_config.json`
    from the folder it is given, finds `file` and the config beside it: the file's own folder when
    the file has that name, else (while the context lasts) a folder of links under those names."""
    if file.name == TOKENIZER_FILE:
        yield file.parent
        return
    with tempfile.TemporaryDirectory(prefix="graph_trainer_tokenizer_") as tmp:
        links = Path(tmp)
        (links / TOKENIZER_FILE).symlink_to(file.resolve())
        config = file.parent / CONFIG_FILE
        if config.is_file():
            (links / CONFIG_FILE).symlink_to(config.resolve())
        yield links


def _config_token(config: dict[str, Any] | None, key: str) -> str | None:
    """A special token of tokenizer_config.json, given as its string or as an AddedToken object (whose
    form torchtitan's wrapper has already checked)."""
    token = (config or {}).get(key)
    return token["content"] if isinstance(token, dict) else token


def document_separator(tokenizer) -> int | None:
    """The token that ends every document in the token stream: EOS, else SEP (WordPiece models have
    one but no EOS), else None (documents are packed back to back)."""
    if tokenizer.eos_id is not None:
        return tokenizer.eos_id
    return getattr(tokenizer, "sep_id", None)


def _load(path: Path) -> Tokenizer | None:
    try:
        return Tokenizer.from_file(str(path))
    except Exception:
        return None


def _find_tokenizer(path: Path) -> Path:
    """The tokenizer file `path` names: the file itself, or in a folder `tokenizer.json`, else its
    only JSON file that loads as a tokenizer."""
    if path.is_dir() and not (path / TOKENIZER_FILE).is_file():
        found = [(p, t) for p in sorted(path.glob("*.json")) if (t := _load(p)) is not None]
        if len(found) != 1:
            names = ", ".join(p.name for p, _ in found) or "none"
            raise TokenizerError(f"model.tokenizer_path {path} must hold exactly one Hugging Face tokenizer file "
                                 f"(found: {names}); pass the file itself")
        return found[0][0]
    file = path / TOKENIZER_FILE if path.is_dir() else path
    try:
        Tokenizer.from_file(str(file))
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TokenizerError(f"model.tokenizer_path {file} is not a Hugging Face tokenizer file ({reason}); "
                             f"save one with tokenizers' Tokenizer.save or transformers' save_pretrained") from None
    return file


def separator_of(tokenizer_path: str) -> int | None:
    """The document separator of a job's tokenizer (`--model.tokenizer_path`; empty: the shipped one), for a model
    built without the job's data (`graph-trainer plan`, a trace on the fake process group)."""
    return document_separator(build_tokenizer(tokenizer_path or None))


def build_tokenizer(path: str | None) -> FileTokenizer:
    """Load a tokenizer: ``None`` is the shipped 2048-token BPE trained on the shipped corpus;
    otherwise ``path`` is a tokenizer file of any name or a folder holding one, with the
    ``tokenizer_config.json`` of the file's folder when there is one."""
    p = ASSETS_DIR / TOKENIZER_FILE if path is None else Path(path)
    if not p.exists():
        raise TokenizerError(f"model.tokenizer_path {path} does not exist; pass a tokenizer file or its folder")
    file = _find_tokenizer(p)
    try:
        return FileTokenizer(file)
    except ValueError as e:
        raise TokenizerError(f"{file.parent / CONFIG_FILE} cannot be read ({e}); fix or remove it") from None
