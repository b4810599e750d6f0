"""`graph-trainer train | precompile | plan | compare | export` (also `python -m graph_trainer`).

Argument and config errors become one line on stderr and exit code 2, before any process group or
model exists; `--help` is rendered by tyro from the config dataclasses.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
from typing import Callable, NoReturn

from .config import ConfigError, JobConfig, parse_args
from .errors import print_error

EXIT_BAD_INPUT = 2


def _error(message: str) -> int:
    print_error(message)
    return EXIT_BAD_INPUT


def _help(command: str) -> int:
    import tyro

    tyro.cli(JobConfig, prog=f"graph-trainer {command} [--config FILE.toml]", args=["--help"],
             description=f"graph-trainer {command}: flags override the TOML given with --config (default configs/llama3_debug.toml).")
    return 0


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING,
                        format="%(asctime)s [graph-trainer] %(message)s", datefmt="%H:%M:%S")


def cmd_train(argv: list[str]) -> int:
    cfg = parse_args(argv)
    if cfg.compile.list_passes:
        from .passes.listing import registry_table

        print(registry_table())
        return 0
    from .worker_processes import start_early, stop_early

    # before the imports the validation and the trainer need: the workers import theirs meanwhile
    start_early(cfg)
    try:
        from .validate import validate

        validate(cfg)
        _setup_logging()
        from .trainer import run

        run(cfg)
    finally:
        stop_early()
    return 0


def cmd_precompile(argv: list[str]) -> int:
    """`graph-trainer precompile` + the job's train flags: fill its compile cache on one process (precompile.py)."""
    cfg = parse_args(argv)
    from .precompile import check, fake_job, precompile
    from .validate import validate

    world_size = check(cfg)
    validate(fake_job(cfg, world_size, 0))
    _setup_logging()
    outcomes = precompile(cfg, world_size)
    per = world_size // cfg.parallelism.pp
    stands = "" if len(outcomes) == world_size else (f" (rank 0 stands for all {world_size})" if cfg.parallelism.pp == 1 else
                                                     f" (each stands for the {per} ranks of its pipeline rank)")
    print(f"precompile: {'; '.join(f'rank {r}: {o}' for r, o in outcomes.items())}{stands}")
    return 0


def cmd_export(argv: list[str]) -> int:
    """`graph-trainer export --checkpoint STEP_FOLDER --out HF_FOLDER`: a saved DCP step as a Hugging Face checkpoint."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="graph-trainer export", description=cmd_export.__doc__)
    parser.add_argument("--checkpoint", required=True, help="a complete step folder, e.g. outputs/checkpoint/step-20")
    parser.add_argument("--out", required=True, help="folder for model.safetensors and config.json; an earlier export there is replaced")
    parser.add_argument("--overwrite", action="store_true", help="replace --out even when it is a non-empty folder that is not an earlier export")
    try:
        opts = parser.parse_args(argv)
    except SystemExit as e:
        return EXIT_BAD_INPUT if e.code else 0
    from .checkpoint import CheckpointError

    _setup_logging()
    from .hf_checkpoint import export

    try:
        export(Path(opts.checkpoint), Path(opts.out), opts.overwrite)
    except CheckpointError as e:
        return _error(str(e))
    return 0


def _commands() -> dict[str, Callable[[list[str]], int]]:
    commands: dict[str, Callable[[list[str]], int]] = {"train": cmd_train, "precompile": cmd_precompile, "export": cmd_export}
    try:
        from .plan import cmd_plan

        commands["plan"] = cmd_plan
    except ImportError:
        pass
    try:
        from .compare import cmd_compare

        commands["compare"] = cmd_compare
    except ImportError:
        pass
    return commands


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: graph-trainer {{{','.join(commands)}}} [--config FILE.toml] [--section.key VALUE ...]\n"
              "       graph-trainer COMMAND --help   lists every flag")
        return 0 if argv else EXIT_BAD_INPUT
    command, rest = argv[0], argv[1:]
    if command not in commands:
        return _error(f"unknown command {command!r}; use one of: {', '.join(commands)}")
    if any(a in ("-h", "--help") for a in rest) and command in ("train", "precompile"):
        return _help(command)
    try:
        return commands[command](rest)
    except ConfigError as e:
        return _error(str(e))


def entry_point() -> NoReturn:
    """The process entry (`graph-trainer`, `python -m graph_trainer`): run, flush, and leave without
    interpreter finalization.

    Gloo's worker threads can still hold work objects whose tensors reference Python objects after the
    process group is destroyed; freeing them while the interpreter tears itself down takes the GIL from
    a dying interpreter and aborts the process ("terminate called without an active exception", exit
    -6) after a run that succeeded (3 times in one run of the test suite, among some 150 multi-rank runs). Everything a run
    writes is closed by then, so the process ends with its code as soon as its output is flushed.

    A rank that dies of a signal (a segfault in a compiled kernel or a collective's worker thread)
    prints every thread's Python stack first: torchrun reports only the signal.
    """
    faulthandler.enable(all_threads=True)
    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
