"""Train the shipped byte-level BPE tokenizer on the shipped corpus.

Run from the repository root:

    PYTHONPATH=. python tools/train_tokenizer.py

It rewrites graph_trainer/data/assets/tokenizer.json and tokenizer_config.json.
"""

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from graph_trainer.data.corpus import ASSETS_DIR, read_documents

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"


def train(documents: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Byte-level pre-tokenization maps every UTF-8 byte to a symbol, so text
    # outside the training corpus still encodes without an unknown token.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"trained vocabulary has {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}"
        )
    return tokenizer


def tokenizer_config() -> dict:
    # torchtitan's HuggingFaceTokenizer finds BOS/EOS only through this file;
    # add_*_token false leaves adding them to the caller (the data loader).
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--corpus", default=None, help="data path for read_documents (default: shipped corpus)"
    )
    parser.add_argument("--output-dir", default=str(ASSETS_DIR))
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args()

    tokenizer = train(read_documents(args.corpus), args.vocab_size)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    print(f"wrote {out / 'tokenizer.json'} ({tokenizer.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
