"""One H200: the 8B dp8 cold start (scale suite, rank 0 of 8, fake communication, caches empty, bytecode compiled
once) with the compile workers at niceness 0 (as before) and 10 (their imports and warm-up yield the cores to the
rank's own imports, init, trace and passes), beside torchtitan compile, three rounds in rotated orders. The niceness
of the experiment's baseline is set through GT_EXPERIMENT_WORKER_NICE (in the working tree for this call only).

    python bench/results/2026-12-01-session31/call4/call4.py $OUT
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
runs = {r.name: r for r in SUITES["scale"](8, 1) if r.group == "8B dp8"}
configs = {"titan compile": ("titan compile", {}),
           "nice 0": ("gt aot_fx_trace full", {"GT_EXPERIMENT_WORKER_NICE": "0"}),
           "nice 10": ("gt aot_fx_trace full", {"GT_EXPERIMENT_WORKER_NICE": "10"})}
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
               "tokens_per_second_steps3_5": [r.get("tokens_per_second") for r in recs[2:5]],
               **{k: rec.get(k) for k in keys if k in rec}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / f"r{rnd + 1}-{name.replace(' ', '')}.log").write_text(output)
(out / "rows.json").write_text(json.dumps(rows, indent=1))
os.system(f"cd {out} && tar czf logs.tgz *.log && rm *.log")
