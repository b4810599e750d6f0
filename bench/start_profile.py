"""Where a job's start-up goes on the host: run `graph-trainer train` under cProfile and print the
functions with the most cumulative time (stats saved beside, for pstats).

    python bench/start_profile.py OUT.prof train --config configs/llama3_8b.toml --training.steps 2 ...

cProfile roughly doubles Python-bound phases (tracing, passes); the step-1 record's own timings
(`trace_s`, `pass_*_s`, `first_call_s`, `optimizer_s`, `init_s`) are the unprofiled figures.
"""

from __future__ import annotations

import cProfile
import pstats
import sys

from graph_trainer.cli import main

if __name__ == "__main__":
    out, argv = sys.argv[1], sys.argv[2:]
    profile = cProfile.Profile()
    profile.enable()
    try:
        main(argv)
    finally:
        profile.disable()
        profile.dump_stats(out)
        pstats.Stats(out).sort_stats("cumulative").print_stats(60)
