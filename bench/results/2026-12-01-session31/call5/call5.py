"""One H200: the 8B dp8 cold start (scale suite, rank 0 of 8, fake communication, caches empty, bytecode compiled once)
with the compile workers at niceness 10, with and without one launch configuration for every pointwise kernel of every
piece (no choice among configurations benchmarked while the pieces compile; as the in-graph update's pieces have),
beside torchtitan compile, three rounds in rotated orders; tokens/s of every step (the last two are the profiler's).
The switch is GT_EXPERIMENT_ONE_POINTWISE (in the working tree for this call only).

    python bench/results/2026-12-01-session31/call5/call5.py $OUT
"""
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import command, dump_folder, launch, records, warm_imports  # noqa: E402
from suites import SUITES  # noqa: E402

out = Path(sys.argv[1])
runs_dir = Path("/tmp/runs31")
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ["PYTHONPYCACHEPREFIX"] = str(runs_dir / "pycache")
runs = {r.name: r for r in SUITES["scale"](16, 1) if r.group == "8B dp8"}
configs = {"titan compile": ("titan compile", {}),
           "nice 10": ("gt aot_fx_trace full", {}),
           "nice 10 one pointwise config": ("gt aot_fx_trace full", {"GT_EXPERIMENT_ONE_POINTWISE": "1"})}
keys = ("before_init_s", "init_s", "trace_s", "compile_s", "compile_workers_ready_s", "compile_workers_first_piece_s",
        "compile_workers_s", "first_call_s", "optimizer_s")
warm_imports()
names = list(configs)
rows = []
for rnd in range(3):
    for name in names[rnd:] + names[:rnd]:
        base, env = configs[name]
        run = runs[base]
        dump = dump_folder(runs_dir, run.group, run.name)
        shutil.rmtree(dump, ignore_errors=True)
        dump.mkdir(parents=True)
        cold = {"TORCHINDUCTOR_CACHE_DIR": str(dump / "inductor_cache"), "TRITON_CACHE_DIR": str(dump / "triton_cache")}
        rc, output, first = launch(command(run, runs_dir), {**os.environ, **cold, **run.env, **env}, 150)
        recs = records(run, dump, output)
        rec = recs[0] if recs else {}
        row = {"round": rnd + 1, "config": name, "rc": rc, "launch_to_step1_s": first,
               "tokens_per_second": [round(r.get("tokens_per_second") or 0) for r in recs],
               **{k: rec.get(k) for k in keys if k in rec}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / f"r{rnd + 1}-{name.replace(' ', '')}.log").write_text(output)
(out / "rows.json").write_text(json.dumps(rows, indent=1))
os.system(f"cd {out} && tar czf logs.tgz *.log && rm *.log")
