"""Deterministic, resumable token batches sharded over data-parallel ranks."""

from typing import Iterable

import torch

from graph_trainer.data.corpus import DataError
from graph_trainer.data.tokens import token_stream


class TokenLoader:
    """Serve fixed-length next-token-prediction batches from documents.

    The documents' token stream (`tokens.token_stream`: memory-mapped from the corpus's token file
    when they come from `read_documents`) is cut into non-overlapping samples of ``seq_len + 1``
    tokens (a tail shorter than that is dropped). Global microbatch ``k`` is samples ``[k*G, (k+1)*G)`` with
    ``G = local_batch_size * dp_degree``, and rank ``r`` takes its contiguous
    slice of ``local_batch_size`` samples from it, so concatenating the ranks'
    batches in rank order gives exactly the batch of a single rank with
    ``local_batch_size * dp_degree``. Sample indices wrap around at the end of
    the stream, each wrap starting a new epoch.
    """

    def __init__(
        self,
        documents: Iterable[str],
        tokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
    ):
        if seq_len < 1 or local_batch_size < 1 or dp_degree < 1:
            raise ValueError(
                f"seq_len, local_batch_size and dp_degree must be positive, got "
                f"{seq_len}, {local_batch_size}, {dp_degree}"
            )
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_degree})")
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree

        self.tokens = token_stream(documents, tokenizer)
        self.num_tokens = self.tokens.numel()
        self.samples_per_epoch = self.num_tokens // (seq_len + 1)
        if self.samples_per_epoch == 0:
            raise DataError(
                f"the documents hold {self.num_tokens} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}; "
                "give more data or a smaller --training.seq_len"
            )
        self._samples = self.tokens[: self.samples_per_epoch * (seq_len + 1)].view(
            self.samples_per_epoch, seq_len + 1
        )
        # Global index of the first sample of the next global microbatch; it
        # keeps growing across epochs and is reduced modulo the epoch length.
        self._next_sample = 0

    @property
    def epoch(self) -> int:
        return self._next_sample // self.samples_per_epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(inputs, labels)``, int64 tensors of shape ``[local_batch_size, seq_len]``."""
        start = self._next_sample + self.dp_rank * self.local_batch_size
        index = torch.arange(start, start + self.local_batch_size) % self.samples_per_epoch
        rows = self._samples[index].long()
        self._next_sample += self.local_batch_size * self.dp_degree
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "sample_in_epoch": self._next_sample % self.samples_per_epoch,
            "seq_len": self.seq_len,
            "local_batch_size": self.local_batch_size,
            "dp_degree": self.dp_degree,
            "num_tokens": self.num_tokens,
        }

    def load_state_dict(self, state: dict) -> None:
        missing = [key for key in self.state_dict() if key not in state]
        if missing:
            raise ValueError(f"loader state lacks {', '.join(missing)}")
        for field in ("seq_len", "local_batch_size", "dp_degree", "num_tokens"):
            if state[field] != getattr(self, field):
                raise ValueError(
                    f"loader state does not match this loader: {field} is "
                    f"{state[field]} in the state but {getattr(self, field)} here"
                )
        self._next_sample = state["epoch"] * self.samples_per_epoch + state["sample_in_epoch"]

