"""Where the trace of the step goes, with and without the in-graph optimizer: `graph-trainer train` for one step with
trace_train_step timed (and, with --profile, under cProfile, the 25 functions of most own time printed).

    python bench/results/2026-11-30-session29/call6/trace_profile.py [--profile] <train flags>
"""
import cProfile
import pstats
import sys
import time

import graph_trainer.capture.fx_trace as fx_trace
from graph_trainer.cli import main

profile = sys.argv[1] == "--profile"
traced = fx_trace.trace_train_step


def timed(*args, **kwargs):
    prof = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if prof:
        prof.enable()
    try:
        return traced(*args, **kwargs)
    finally:
        if prof:
            prof.disable()
        print(f"trace_train_step {time.perf_counter() - start:.2f} s", flush=True)
        if prof:
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)


fx_trace.trace_train_step = timed
main(["train", *sys.argv[1 + profile:]])
