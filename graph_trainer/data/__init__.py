"""Text corpus, tokenizer, token file and token dataloader for training."""

from graph_trainer.data.corpus import DataError, Documents, read_documents
from graph_trainer.data.loader import TokenLoader
from graph_trainer.data.tokenizer import build_tokenizer, document_separator

__all__ = ["DataError", "Documents", "TokenLoader", "build_tokenizer", "document_separator", "read_documents"]
