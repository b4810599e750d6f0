"""Loading the tokenizer through torchtitan's HuggingFace tokenizer wrapper."""

from pathlib import Path

from torchtitan.components.tokenizer import HuggingFaceTokenizer

from graph_trainer.data.corpus import ASSETS_DIR

TOKENIZER_FILE = "tokenizer.json"


def build_tokenizer(path: str | None) -> HuggingFaceTokenizer:
    """Load a byte-level BPE tokenizer.

    ``None`` loads the shipped 2048-token tokenizer trained on the shipped
    corpus. Otherwise ``path`` is a ``tokenizer.json`` file or a directory
    holding one; BOS/EOS come from a ``tokenizer_config.json`` beside it.
    """
    if path is None:
        return HuggingFaceTokenizer(str(ASSETS_DIR))
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path does not exist: {path}")
    if p.is_file():
        # torchtitan's wrapper takes the directory and reads fixed file names
        # from it, so a file under another name would be silently ignored.
        if p.name != TOKENIZER_FILE:
            raise ValueError(f"tokenizer file must be named {TOKENIZER_FILE}: {path}")
        return HuggingFaceTokenizer(str(p.parent))
    if not (p / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in tokenizer directory: {path}")
    return HuggingFaceTokenizer(str(p))
