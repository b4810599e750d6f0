"""Text corpus, tokenizer and token dataloader for training."""

from graph_trainer.data.corpus import read_documents
from graph_trainer.data.loader import TokenLoader
from graph_trainer.data.tokenizer import build_tokenizer, document_separator

__all__ = ["TokenLoader", "build_tokenizer", "document_separator", "read_documents"]
