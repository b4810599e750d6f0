"""One H200: call 1 again with the cut moved: each recomputed block's backward cut after its last recomputed matmul or
attention, the recomputed ops that none of them reads moved after it (../recomputation_cut.patch applied to 3b86cda),
against one piece (`GT_EXPERIMENT_WHOLE_RECOMPUTE`, the patch's switch); the cut without the in-graph optimizer;
torchtitan compile; three rounds in rotated orders.

    python bench/results/2026-12-02-session34/call2/call2.py $OUT
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import cold_rounds  # noqa: E402
from suites import SUITES  # noqa: E402

runs = {r.name: r for r in SUITES["scale"](16, 1) if r.group == "8B dp8"}
configs = {"in graph, recomputation cut": (runs["gt full + optimizer_in_graph"], {}),
           "titan compile": (runs["titan compile"], {}),
           "in graph, recomputation whole": (runs["gt full + optimizer_in_graph"], {"GT_EXPERIMENT_WHOLE_RECOMPUTE": "1"}),
           "ours, recomputation cut": (runs["gt aot_fx_trace full"], {})}
cold_rounds(configs, 3, Path("/tmp/runs34b"), Path(sys.argv[1]), 150)
