"""One H200: call 1 again on the code to commit (one launch configuration per pointwise and per reduction kernel,
`inductor.ONE_CONFIG_PER_KERNEL`) against pointwise alone (session 31's code: GT_EXPERIMENT_AUTOTUNE_REDUCTIONS
drops the reduction option, in the working tree for this call only), beside torchtitan compile, four rounds in
rotated orders. After each of ours, from its Inductor cache, how many generated reduction kernels carry the option in their
metadata (where Inductor's configuration filter reads it).

    python bench/results/2026-12-01-session32/call2/call2.py $OUT
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import launch_cold, records, warm_imports  # noqa: E402
from suites import SUITES  # noqa: E402

import torch._inductor.config as inductor_config  # noqa: E402

print("torch", __import__("torch").__version__, "force_filter_reduction_configs:",
      inductor_config.test_configs.force_filter_reduction_configs, flush=True)
out = Path(sys.argv[1])
runs_dir = Path("/tmp/runs32b")
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ["PYTHONPYCACHEPREFIX"] = str(runs_dir / "pycache")
runs = {r.name: r for r in SUITES["scale"](16, 1) if r.group == "8B dp8"}
configs = {"titan compile": ("titan compile", {}),
           "ours": ("gt aot_fx_trace full", {}),
           "pointwise only": ("gt aot_fx_trace full", {"GT_EXPERIMENT_AUTOTUNE_REDUCTIONS": "1"})}
keys = ("before_init_s", "init_s", "trace_s", "compile_s", "compile_workers_ready_s", "compile_workers_first_piece_s",
        "compile_workers_s", "first_call_s")
warm_imports()
names = list(configs)
rows = []
for rnd in range(4):
    for name in names[rnd % 3:] + names[:rnd % 3] if rnd < 3 else names[::-1]:
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
        (out / f"r{rnd + 1}-{name.replace(' ', '')}.log").write_text(output)
        if name != "titan compile":
            kernels = [p.read_text() for p in (dump / "inductor_cache").rglob("*.py")]
            red = [k for k in kernels if "@triton_heuristics.reduction" in k or "@triton_heuristics.persistent_reduction" in k]
            print(json.dumps({"round": rnd + 1, "config": name, "generated_files": len(kernels), "reduction_kernels": len(red),
                              "with_filter_option": sum("'force_filter_reduction_configs': True" in k for k in red)}), flush=True)
(out / "rows.json").write_text(json.dumps(rows, indent=1))
os.system(f"cd {out} && tar czf logs.tgz *.log && rm *.log")
