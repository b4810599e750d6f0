"""One H200: the 8B dp8 cold start (scale suite, rank 0 of 8, fake communication, caches empty, bytecode compiled
once), with the in-graph optimizer: the step priced once, while the compile workers compile (the code to commit),
against priced twice before the compile (session 32's code: GT_EXPERIMENT_PRICE_TWICE, in the working tree for this
call only); the code to commit without the in-graph optimizer too; beside torchtitan compile, three rounds in rotated
orders.

    python bench/results/2026-12-01-session33/call1/call1.py $OUT
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import launch_cold, records, warm_imports  # noqa: E402
from suites import SUITES  # noqa: E402

out = Path(sys.argv[1])
runs_dir = Path("/tmp/runs33a")
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ["PYTHONPYCACHEPREFIX"] = str(runs_dir / "pycache")
runs = {r.name: r for r in SUITES["scale"](16, 1) if r.group == "8B dp8"}
configs = {"titan compile": ("titan compile", {}),
           "in graph, priced once meanwhile": ("gt full + optimizer_in_graph", {}),
           "in graph, priced twice before": ("gt full + optimizer_in_graph", {"GT_EXPERIMENT_PRICE_TWICE": "1"}),
           "ours, priced once meanwhile": ("gt aot_fx_trace full", {})}
keys = ("before_init_s", "init_s", "trace_s", "compile_s", "compile_workers_ready_s", "compile_workers_first_piece_s",
        "compile_workers_s", "first_call_s", "step_estimate_train_step_s", "pass_inductor_decomposition_s")
warm_imports()
names = list(configs)
rows = []
for rnd in range(3):
    for name in names[rnd % 4:] + names[:rnd % 4]:
        base, env = configs[name]
        run = runs[base]
        dump, rc, output, first = launch_cold(run, runs_dir, 150, env=env)
        recs = records(run, dump, output)
        rec = recs[0] if recs else {}
        row = {"round": rnd + 1, "config": name, "rc": rc, "launch_to_step1_s": first,
               "tokens_per_second": [round(r.get("tokens_per_second") or 0) for r in recs],
               **{k: rec.get(k) for k in keys if k in rec}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / f"r{rnd + 1}-{name.replace(' ', '').replace(',', '')}.log").write_text(output)
        (out / "rows.json").write_text(json.dumps(rows, indent=1))
os.system(f"cd {out} && tar czf logs.tgz *.log && rm *.log")
