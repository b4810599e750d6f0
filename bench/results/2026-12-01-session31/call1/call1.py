"""One H200: where the 8B dp8 cold start's seconds go on each trainer's main thread. The scale suite's `titan compile`
and `gt aot_fx_trace full` (rank 0 of 8, fake communication, Inductor's and Triton's caches empty, bytecode compiled
once), each under py-spy (sampling from outside the process, 100 Hz, idle samples kept), two rounds in opposite orders;
then each once more without py-spy. Writes each run's speedscope profile and its log.

    python bench/results/2026-12-01-session31/call1/call1.py $OUT    (py-spy's wheel among .whl/)
"""
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import dump_folder, launch, records, warm_imports  # noqa: E402
from runner import command  # noqa: E402
from suites import SUITES  # noqa: E402

out = Path(sys.argv[1])
runs_dir = Path("/tmp/runs31")
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ["PYTHONPYCACHEPREFIX"] = str(runs_dir / "pycache")
pyspy = shutil.which("py-spy") or str(Path(os.environ["PYTHONPATH"].split(":")[0]) / "bin" / "py-spy")
runs = {r.name: r for r in SUITES["scale"](8, 1) if r.group == "8B dp8"}
warm_imports()
keys = ("before_init_s", "init_s", "trace_s", "compile_s", "compile_workers_first_piece_s", "compile_workers_ready_s",
        "compile_workers_s", "first_call_s", "optimizer_s")
plan = [("titan compile", True), ("gt aot_fx_trace full", True), ("gt aot_fx_trace full", True), ("titan compile", True),
        ("titan compile", False), ("gt aot_fx_trace full", False)]
for i, (name, sampled) in enumerate(plan):
    run = runs[name]
    dump = dump_folder(runs_dir, run.group, run.name)
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    cold = {"TORCHINDUCTOR_CACHE_DIR": str(dump / "inductor_cache"), "TRITON_CACHE_DIR": str(dump / "triton_cache")}
    tag = f"{i}-{'titan' if run.trainer == 'titan' else 'gt'}"
    prof = out / f"{tag}.speedscope.json"
    cmd = command(run, runs_dir)
    if sampled:
        cmd = [pyspy, "record", "--rate", "100", "--idle", "--nonblocking", "--format", "speedscope", "-o", str(prof), "--", *cmd]
    rc, output, first = launch(cmd, {**os.environ, **cold, **run.env}, 150)
    (out / f"{tag}.log").write_text(output)
    first_rec = records(run, dump, output)[:1]
    rec = first_rec[0] if first_rec else {}
    print(tag, name, "py-spy" if sampled else "plain", f"rc {rc} launch to step 1 {first}", {k: rec.get(k) for k in keys if k in rec}, flush=True)
    if prof.exists():
        prof.with_suffix(".json.gz").write_bytes(gzip.compress(prof.read_bytes()))
        prof.unlink()
subprocess.run(f"cd {out} && tar czf logs.tgz *.log && rm *.log && tar cf profiles.tar *.gz && rm *.gz", shell=True, check=True)
