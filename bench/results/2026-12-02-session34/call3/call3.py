"""One H200: the steady state of calls 1-2's A/B, which start-up runs of 11 steps leave within noise (0.1-0.9%): the
8B dp8 run with the in-graph optimizer for 40 steps, each recomputed block's backward cut as ../recomputation_cut.patch
(applied to 3b86cda) cuts it against one piece (`GT_EXPERIMENT_WHOLE_RECOMPUTE`, the patch's switch), alternating,
three rounds; tokens/s of steps 11-40.

    python bench/results/2026-12-02-session34/call3/call3.py $OUT
"""
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import cold_rounds  # noqa: E402
from suites import SUITES  # noqa: E402

run = {r.name: r for r in SUITES["scale"](16, 1) if r.group == "8B dp8"}["gt full + optimizer_in_graph"]
run = dataclasses.replace(run, args=[*run.args, "--training.steps", "40"])
configs = {"recomputation cut": (run, {}), "recomputation whole": (run, {"GT_EXPERIMENT_WHOLE_RECOMPUTE": "1"})}
cold_rounds(configs, 3, Path("/tmp/runs34c"), Path(sys.argv[1]), 150)
