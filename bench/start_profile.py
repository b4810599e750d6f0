"""Where a job's start-up goes on the host: run `graph-trainer train` under cProfile and print the
functions with the most cumulative time (stats saved beside, for pstats).

    python bench/start_profile.py OUT.prof train --config configs/llama3_8b.toml --training.steps 2 ...
    python bench/start_profile.py OUT.prof --pass inductor_decomposition train ...   # that pass alone, then exit

cProfile roughly doubles Python-bound phases (tracing, passes); the step-1 record's own timings
(`trace_s`, `pass_*_s`, `first_call_s`, `optimizer_s`, `init_s`) are the unprofiled figures.
"""

from __future__ import annotations

import cProfile
import dataclasses
import os
import pstats
import sys

from graph_trainer.cli import main
from graph_trainer.passes.registry import PASSES


def _report(profile: cProfile.Profile, out: str) -> None:
    profile.dump_stats(out)
    pstats.Stats(out).sort_stats("cumulative").print_stats(60)
    sys.stdout.flush()


def profile_pass(name: str, out: str) -> None:
    """Profile the first run of the registered pass `name`, report, and end the process."""
    spec = PASSES[name]

    def profiled(gm, ctx):
        profile = cProfile.Profile()
        profile.enable()
        try:
            return spec.fn(gm, ctx)
        finally:
            profile.disable()
            _report(profile, out)
            os._exit(0)

    PASSES[name] = dataclasses.replace(spec, fn=profiled)


if __name__ == "__main__":
    out, argv = sys.argv[1], sys.argv[2:]
    if argv[:1] == ["--pass"]:
        profile_pass(argv[1], out)
        main(argv[2:])
    else:
        profile = cProfile.Profile()
        profile.enable()
        try:
            main(argv)
        finally:
            profile.disable()
            _report(profile, out)
