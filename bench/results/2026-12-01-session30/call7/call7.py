"""One H200: where the in-graph optimizer's cold start goes. The scale suite's `8B dp8: gt full + optimizer_in_graph`
and `gt aot_fx_trace full` (3 steps each, cold, bytecode compiled once) run in this process under cProfile through
`graph_trainer.cli.main` (the console entry ends with os._exit, which would lose the profile); prints the step-1 record's
start fields and writes each profile's top functions by cumulative time to `<run>.txt`.

    python bench/results/2026-12-01-session30/call7/call7.py $OUT
"""
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import IMPORTS  # noqa: E402
from suites import SUITES  # noqa: E402

out = Path(sys.argv[1])
name = sys.argv[2] if len(sys.argv) > 2 else ""
if not name:
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = "/tmp/pycache7"
    subprocess.run([sys.executable, "-c", IMPORTS], check=False, capture_output=True)
    for run in ("gt full + optimizer_in_graph", "gt aot_fx_trace full"):
        # a fresh process each: the second would find the first's imports and CUDA context
        subprocess.run([sys.executable, __file__, str(out), run], check=True)
    raise SystemExit(0)

run = next(r for r in SUITES["scale"](12, 1) if r.group == "8B dp8" and r.name == name)
args = list(run.args)
args[args.index("--training.steps") + 1] = "3"
tag = name.replace(" ", "_").replace("+", "p")
dump = Path(f"/tmp/c7/{tag}")
os.environ.update(TORCHINDUCTOR_CACHE_DIR=str(dump) + "-inductor", TRITON_CACHE_DIR=str(dump) + "-triton")
from graph_trainer.cli import main  # noqa: E402

profile = cProfile.Profile()
profile.enable()
code = main(["train", *args, "--job.dump_folder", str(dump)])
profile.disable()
text = io.StringIO()
pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(120)
(out / f"{tag}.txt").write_text(text.getvalue())
first = json.loads((dump / "metrics.jsonl").read_text().splitlines()[0])
print(name, "rc", code, {k: round(v, 2) for k, v in first.items() if k.endswith("_s") and isinstance(v, float)}, flush=True)
