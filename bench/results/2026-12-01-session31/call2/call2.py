"""One H200: the 8B dp8 cold start of `gt aot_fx_trace full` (scale suite, rank 0 of 8, fake communication, caches
empty, bytecode compiled once) under py-spy with its subprocesses (the compile workers and their Triton compile
processes), 100 Hz, idle samples kept: where the workers' part of the start goes.

    python bench/results/2026-12-01-session31/call2/call2.py $OUT    (py-spy's wheel among .whl/)
"""
import gzip
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
pyspy = str(Path(os.environ["PYTHONPATH"].split(":")[0]) / "bin" / "py-spy")
run = next(r for r in SUITES["scale"](8, 1) if r.group == "8B dp8" and r.name == "gt aot_fx_trace full")
warm_imports()
for i in range(2):
    dump = dump_folder(runs_dir, run.group, run.name)
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    cold = {"TORCHINDUCTOR_CACHE_DIR": str(dump / "inductor_cache"), "TRITON_CACHE_DIR": str(dump / "triton_cache")}
    prof = out / f"gt{i}.speedscope.json"
    cmd = [pyspy, "record", "--subprocesses", "--rate", "100", "--idle", "--nonblocking", "--format", "speedscope",
           "-o", str(prof), "--", *command(run, runs_dir)]
    rc, output, first = launch(cmd, {**os.environ, **cold, **run.env}, 150)
    (out / f"gt{i}.log").write_text(output)
    rec = (records(run, dump, output) or [{}])[0]
    print(i, f"rc {rc} launch to step 1 {first}", {k: v for k, v in rec.items() if k.endswith("_s")}, flush=True)
    prof.with_suffix(".json.gz").write_bytes(gzip.compress(prof.read_bytes()))
    prof.unlink()
