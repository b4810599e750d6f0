"""The one line every user-facing failure prints, shared by the CLI and the trainer (which sits below
the CLI and so cannot import it)."""

from __future__ import annotations

import os
import sys


def print_error(message: str) -> None:
    """`graph-trainer: error: MESSAGE` on stderr, with the rank when there are several."""
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    print(f"{prefix}graph-trainer: error: {message}", file=sys.stderr, flush=True)
