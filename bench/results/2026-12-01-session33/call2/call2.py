"""One H200: llama3 70B's cold start as rank 0 of dp_shard 32 (scale suite's `70B dp32`: fake communication, full AC,
caches empty, bytecode compiled once), ours with and without the in-graph optimizer beside torchtitan compile, in the
same call (the last 70B figures, 31.9 s against torchtitan's 20.6 s, came from two calls).

    python bench/results/2026-12-01-session33/call2/call2.py $OUT
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import cold_rounds  # noqa: E402
from suites import SUITES  # noqa: E402

runs = {r.name: r for r in SUITES["scale"](16, 1) if r.group == "70B dp32"}
configs = {"ours + optimizer in graph": (runs["gt full + optimizer_in_graph"], {}),
           "titan compile": (runs["titan compile"], {}),
           "ours": (runs["gt aot_fx_trace full"], {})}
cold_rounds(configs, 1, Path("/tmp/runs33b"), Path(sys.argv[1]), 280)
