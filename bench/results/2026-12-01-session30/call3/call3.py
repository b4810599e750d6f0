"""One H200: the scale suite's 8B dp8 (rank 0 of 8, fake communication, selective AC every 2nd layer) cold, with each
block's backward compiled in two pieces (the default since this call's code) and in one (`--compile.backward_halves
false`), and with the in-graph optimizer (`gt full + optimizer_in_graph`, halves), beside torchtitan compile, in two rounds of opposite order; every run cold (the suite's runner: its own
Inductor and Triton caches), Python's bytecode compiled once beforehand. Prints each run's launch to step 1, the
workers' part of the compile, the profiled step's span and tokens/s.

    python bench/results/2026-12-01-session30/call3/call3.py $OUT
"""
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import run_suite  # noqa: E402
from suites import SUITES  # noqa: E402

out = Path(sys.argv[1])
runs_dir = Path("/tmp/runs3")
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ["PYTHONPYCACHEPREFIX"] = str(runs_dir / "pycache")
runs = {r.name: r for r in SUITES["scale"](12, 1) if r.group == "8B dp8"}
titan, halves, opt = runs["titan compile"], runs["gt aot_fx_trace full"], runs["gt full + optimizer_in_graph"]
one = replace(halves, name="gt full one-piece backward", args=[*halves.args, "--compile.backward_halves", "false"])
keys = ("launch_to_first_step_s", "tokens_per_second", "profiled_step_ms", "trace_kernel_span_ms", "peak_memory_gib",
        "compile_workers_s", "compile_workers_first_piece_s", "compiled_blocks", "block_pieces", "first_call_s", "error")
for n, order in enumerate(([titan, halves, one, opt], [opt, one, halves, titan]), 1):
    results = run_suite(order, runs_dir / f"round{n}", 150, [], lambda _: None)
    (out / f"round{n}.json").write_text(json.dumps(results, indent=1))
    for r in results:
        print(f"round {n}", r["name"], {k: r.get(k) for k in keys}, flush=True)
