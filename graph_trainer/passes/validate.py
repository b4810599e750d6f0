"""Checks of `--compile.passes` and `--compile.inductor_compilation` against the registry's declared
constraints, run before any process group, model or trace exists.

The list checked is the one that will run: the backend's `pass_names(user_passes)`, i.e. the user's
passes with the backend's own (regional_inductor; inductor_decomposition + full_inductor_compilation)
inserted. An error about a pass the backend added says so, because its fix is a different flag.
"""

from __future__ import annotations

import difflib
import os
from typing import Callable

from ..config import ConfigError, JobConfig
from .registry import GRAPH_MODES, PassSpec, load_passes


def _unknown(name: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown pass {name!r}{hint}; see --compile.list_passes for the valid names")


def _backend_passes(cfg: JobConfig) -> list[str]:
    from graph_trainer.backends import backend_names, get_backend

    backend = cfg.compile.inductor_compilation
    if backend not in backend_names():
        raise ConfigError(
            f"--compile.inductor_compilation {backend} is not available in this install; "
            f"use one of: {', '.join(backend_names())}"
        )
    return get_backend(backend).pass_names(list(cfg.compile.passes))


def check_passes(cfg: JobConfig, device_type: str) -> None:
    """Raise a one-line ConfigError for the first pass constraint the config breaks; when all hold,
    set the environment defaults the chosen passes declare (this runs on every rank before any
    process group exists, which is when such variables must be set)."""
    passes = load_passes()
    user = list(cfg.compile.passes)
    mode, backend = cfg.compile.mode, cfg.compile.inductor_compilation
    for name in user:
        if name not in passes:
            raise _unknown(name, sorted(passes))
    for name in user:
        if user.count(name) > 1:
            raise ConfigError(f"pass {name!r} is listed {user.count(name)} times in --compile.passes; list it once")

    names = _backend_passes(cfg)
    added = {n for n in names if n not in user}

    def label(name: str) -> str:
        return f"{name!r} (added by --compile.inductor_compilation {backend})" if name in added else repr(name)

    if mode not in GRAPH_MODES and names:
        first = names[0]
        drop = "--compile.inductor_compilation none" if first in added else "drop --compile.passes"
        raise ConfigError(
            f"--compile.mode {mode} captures no graph, so pass {label(first)} cannot run; "
            f"use --compile.mode aot_fx_trace (or jit/aot), or {drop}"
        )
    specs = [passes[n] for n in names]
    for i, spec in enumerate(specs):
        _check_one(i, specs, added, label, mode, backend, device_type)
    for spec in specs:
        for key, value in spec.env_defaults:
            os.environ.setdefault(key, value)


def _check_one(i: int, specs: list[PassSpec], added: set[str], label: Callable[[str], str], mode: str,
               backend: str, device_type: str) -> None:
    spec = specs[i]
    name = spec.name
    names = [s.name for s in specs]
    other_backend = f"another --compile.inductor_compilation than {backend}"
    if backend in spec.excluded_backends:
        raise ConfigError(
            f"pass {name!r} cannot run with --compile.inductor_compilation {backend}: it does its own "
            f"{name.replace('_', ' ')}; remove {name!r} from --compile.passes"
        )
    if mode not in spec.modes:
        remedy = f"use {other_backend}" if name in added else f"remove {name!r} from --compile.passes"
        raise ConfigError(
            f"pass {label(name)} does not support --compile.mode {mode}; use --compile.mode "
            f"{' or '.join(spec.modes)}, or {remedy}"
        )
    if spec.cuda_only and device_type != "cuda":
        raise ConfigError(f"pass {label(name)} needs a CUDA device and this run is on {device_type}; remove it from --compile.passes")
    for j, other in enumerate(specs):
        if j != i and (other.name in spec.conflicts or name in other.conflicts):
            mine = [n for n in (name, other.name) if n not in added]
            remedy = (f"remove {mine[0]!r} from --compile.passes or use {other_backend}" if len(mine) == 1
                      else "remove one of them from --compile.passes")
            raise ConfigError(f"pass {label(name)} conflicts with {label(other.name)}; {remedy}")
    for req in spec.requires:
        if req not in names:
            raise ConfigError(f"pass {label(name)} requires {req!r}; add {req!r} before {name!r} in --compile.passes")
        if names.index(req) > i:
            raise ConfigError(f"pass {name!r} requires {req!r} to run before it; put {req!r} before {name!r} in --compile.passes")
    later = specs[i + 1 :]
    if spec.must_be_last and later:
        raise ConfigError(
            f"pass {name!r} must be the last pass but {label(later[0].name)} follows it; "
            f"move {name!r} to the end of --compile.passes"
        )
    if spec.compiles:
        for nxt in later:
            if not nxt.wraps_compiled:
                raise ConfigError(
                    f"pass {label(nxt.name)} transforms a graph but comes after {label(name)}, which compiles it; "
                    f"put {nxt.name!r} before {name!r} in --compile.passes"
                )
