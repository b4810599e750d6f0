"""Checks of `--compile.passes` against the registry's declared constraints (extended by the
registry's owner)."""

from __future__ import annotations

import difflib

from ..config import ConfigError, JobConfig
from .registry import load_passes


def check_passes(cfg: JobConfig, device_type: str) -> None:
    passes = load_passes()
    for name in cfg.compile.passes:
        if name not in passes:
            close = difflib.get_close_matches(name, list(passes), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown pass {name!r}{hint}; see --compile.list_passes")
