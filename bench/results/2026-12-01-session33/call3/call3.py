"""One H200: call 2 again (llama3 70B as rank 0 of dp_shard 32, cold), one round in another order: torchtitan compile
first, then ours, then ours with the in-graph optimizer.

    python bench/results/2026-12-01-session33/call3/call3.py $OUT
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import cold_rounds  # noqa: E402
from suites import SUITES  # noqa: E402

runs = {r.name: r for r in SUITES["scale"](16, 1) if r.group == "70B dp32"}
configs = {"titan compile": (runs["titan compile"], {}),
           "ours": (runs["gt aot_fx_trace full"], {}),
           "ours + optimizer in graph": (runs["gt full + optimizer_in_graph"], {})}
cold_rounds(configs, 1, Path("/tmp/runs33c"), Path(sys.argv[1]), 280)
