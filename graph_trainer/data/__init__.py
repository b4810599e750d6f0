"""Text corpus, tokenizer and token dataloader for training."""

from graph_trainer.data.corpus import read_documents
from graph_trainer.data.loader import TokenLoader
from graph_trainer.data.tokenizer import build_tokenizer

__all__ = ["TokenLoader", "build_tokenizer", "read_documents"]
