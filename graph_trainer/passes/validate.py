"""Checks of `--compile.passes` and `--compile.inductor_compilation` against the registry's declared
constraints, run before any process group, model or trace exists.

The list checked is the one that will run: the backend's `pass_names(user_passes)`, i.e. the user's
passes with the backend's own (regional_inductor; inductor_decomposition + full_inductor_compilation)
inserted. An error about a pass the backend added says so, because its fix is a different flag.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, JobConfig
from .registry import GRAPH_MODES, OPTIONS, PASSES, OptionSpec, PassSpec


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
    from .memory_policy import activation_passes
    from .reshard import parameter_passes

    policy = parameter_passes(cfg) if cfg.compile.mode in GRAPH_MODES else []
    return policy + activation_passes(cfg) + get_backend(backend).pass_names(list(cfg.compile.passes))


def check_passes(cfg: JobConfig, device_type: str) -> None:
    """Raise a one-line ConfigError for the first pass constraint the config breaks; when all hold,
    set the environment defaults the chosen passes declare (this runs on every rank before any
    process group exists, which is when such variables must be set)."""
    user = list(cfg.compile.passes)
    mode, backend = cfg.compile.mode, cfg.compile.inductor_compilation
    for name in user:
        if name not in PASSES:
            raise _unknown(name, sorted(PASSES))
    for name in user:
        if PASSES[name].set_by:
            raise ConfigError(f"pass {name!r} is added by {PASSES[name].set_by}; remove it from --compile.passes")
    for name in user:
        if user.count(name) > 1:
            raise ConfigError(f"pass {name!r} is listed {user.count(name)} times in --compile.passes; list it once")

    for name in user:
        if backend in PASSES[name].excluded_backends:
            raise ConfigError(
                f"pass {name!r} cannot run with --compile.inductor_compilation {backend}: it does its own "
                f"{name.replace('_', ' ')}; remove {name!r} from --compile.passes"
            )

    plan = _Plan([PASSES[n] for n in _backend_passes(cfg)], set(user), mode, backend, device_type)
    plan.check()
    check_degrees(cfg, plan)
    check_options(cfg, plan)
    for spec in plan.specs:
        for key, value in spec.env_defaults:
            os.environ.setdefault(key, value)


def check_degrees(cfg: JobConfig, plan: "_Plan") -> None:
    """Each pass's declared parallelism (PassSpec.needs_degrees): without it there is nothing to transform."""
    for spec in plan.specs:
        for name in spec.needs_degrees:
            degree = getattr(cfg.parallelism, name)
            if degree <= 1:
                raise ConfigError(f"pass {plan.label(spec.name)} needs --parallelism.{name} > 1 and this job has "
                                  f"--parallelism.{name} {degree}; raise it or remove {spec.name!r} from --compile.passes")


def _setting(cfg: JobConfig, flag: str) -> object:
    section, key = flag.split(".")
    return getattr(getattr(cfg, section), key)


def _as_flag(flag: str, value: object) -> str:
    if value is True:
        return f"--{flag}"
    return f"--{flag} {str(value).lower() if isinstance(value, bool) else value}"


def check_options(cfg: JobConfig, plan: "_Plan") -> None:
    """The declared constraints (registry.OPTIONS) of every lever that is a setting and is on."""
    for option in OPTIONS:
        if _setting(cfg, option.flag) == option.on:
            _check_option(cfg, option, plan)


def turning_off(flag: str, on: Any) -> str:
    """How to turn a lever off: a switch by its negated flag, which also overrides a config that sets it."""
    if on is True:
        section, _, key = flag.rpartition(".")
        return f"pass --{section}.no-{key}"
    return f"drop {_as_flag(flag, on)}"


def _check_option(cfg: JobConfig, option: OptionSpec, plan: "_Plan") -> None:
    lever, off = _as_flag(option.flag, option.on), turning_off(option.flag, option.on)
    if plan.mode not in option.modes:
        raise ConfigError(f"{lever} does not support --compile.mode {plan.mode}; use --compile.mode "
                          f"{' or '.join(option.modes)}, or {off}")
    if plan.backend in option.excluded_backends:
        raise ConfigError(f"{lever} cannot run with --compile.inductor_compilation {plan.backend}; use another backend "
                          f"(none, regional or full) or {off}")
    for spec in plan.specs:
        if spec.name in option.conflicts:
            remedy = f"remove {spec.name!r} from --compile.passes" if spec.name in plan.user else "use another backend"
            raise ConfigError(f"{lever} conflicts with pass {plan.label(spec.name)}; {remedy} or {off}")
    for flag, value, why in option.requires:
        if _setting(cfg, flag) != value:
            raise ConfigError(f"{lever} needs {_as_flag(flag, value)} ({why}); "
                              f"this job has {_as_flag(flag, _setting(cfg, flag))}")


@dataclass
class _Plan:
    """The pass list that will run, and what it is checked against."""

    specs: list[PassSpec]
    user: set[str]
    mode: str
    backend: str
    device_type: str

    def label(self, name: str) -> str:
        """A pass as errors name it: where it did not come from --compile.passes, who added it."""
        if name in self.user:
            return repr(name)
        return f"{name!r} (added by {PASSES[name].set_by or '--compile.inductor_compilation ' + self.backend})"

    def check(self) -> None:
        if self.mode not in GRAPH_MODES and self.specs:
            first = self.specs[0].name
            drop = "drop --compile.passes" if first in self.user else "--compile.inductor_compilation none"
            raise ConfigError(
                f"--compile.mode {self.mode} captures no graph, so pass {self.label(first)} cannot run; "
                f"use --compile.mode aot_fx_trace (or jit/aot), or {drop}"
            )
        for check in (self._support, self._conflicts, self._requires, self._last, self._after_compile):
            for i in range(len(self.specs)):
                check(i)

    def _support(self, i: int) -> None:
        spec = self.specs[i]
        if self.mode not in spec.modes:
            remedy = (f"remove {spec.name!r} from --compile.passes" if spec.name in self.user
                      else f"use another {spec.set_by}" if spec.set_by
                      else f"use another --compile.inductor_compilation than {self.backend}")
            raise ConfigError(
                f"pass {self.label(spec.name)} does not support --compile.mode {self.mode}; use --compile.mode "
                f"{' or '.join(spec.modes)}, or {remedy}"
            )
        if spec.cuda_only and self.device_type != "cuda":
            raise ConfigError(
                f"pass {self.label(spec.name)} needs a CUDA device and this run is on {self.device_type}; "
                "remove it from --compile.passes"
            )

    def _conflicts(self, i: int) -> None:
        spec = self.specs[i]
        for other in self.specs[i + 1 :]:
            if other.name in spec.conflicts or spec.name in other.conflicts:
                mine = [n for n in (spec.name, other.name) if n in self.user]
                remedy = (f"remove {mine[0]!r} from --compile.passes or use another --compile.inductor_compilation "
                          f"than {self.backend}" if len(mine) == 1 else "remove one of them from --compile.passes")
                raise ConfigError(f"pass {self.label(spec.name)} conflicts with {self.label(other.name)}; {remedy}")

    def _requires(self, i: int) -> None:
        name = self.specs[i].name
        names = [s.name for s in self.specs]
        for req in self.specs[i].requires:
            if req not in names:
                raise ConfigError(f"pass {self.label(name)} requires {req!r}; add {req!r} before {name!r} in --compile.passes")
            if names.index(req) > i:
                raise ConfigError(
                    f"pass {name!r} requires {req!r} to run before it; put {req!r} before {name!r} in --compile.passes"
                )

    def _last(self, i: int) -> None:
        if self.specs[i].must_be_last and i + 1 < len(self.specs):
            name = self.specs[i].name
            raise ConfigError(
                f"pass {name!r} must be the last pass but {self.label(self.specs[i + 1].name)} follows it; "
                f"move {name!r} to the end of --compile.passes"
            )

    def _after_compile(self, i: int) -> None:
        if not self.specs[i].compiles:
            return
        name = self.specs[i].name
        for nxt in self.specs[i + 1 :]:
            if not nxt.wraps_compiled:
                raise ConfigError(
                    f"pass {self.label(nxt.name)} transforms a graph but comes after {self.label(name)}, which "
                    f"compiles it; put {nxt.name!r} before {name!r} in --compile.passes"
                )
