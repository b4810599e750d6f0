# one H200, fake communication: configs/llama3_8b.toml as the README runs it (rank 0 of dp_shard 8, the memory policy
# filling the device), and the same with the fused linear + cross-entropy loss, beside torchtitan compile (the scale
# suite's 8B dp8 run, selective AC); each from a cold compile, its own Inductor and Triton caches
O=$1
timeout 200 python bench/run.py --suite scale --groups "8B dp8" --only "titan compile" --steps 9 --timeout 150 --out $O/titan --runs-dir /tmp/runs_s24c7 --bytecode-cache > $O/titan.out 2>&1
for loss in cross_entropy fused_linear_ce; do
  D=/tmp/runs_s24c7/config_$loss; rm -rf $D
  TORCHINDUCTOR_CACHE_DIR=$D/inductor_cache TRITON_CACHE_DIR=$D/triton_cache timeout 200 python -m graph_trainer train --config configs/llama3_8b.toml --comm.mode fake --comm.fake_world_size 8 --parallelism.dp_shard 8 --training.random_tokens --training.steps 9 --metrics.log_freq 1 --training.loss $loss --job.dump_folder $D > $O/$loss.log 2>&1
  cp $D/metrics.jsonl $O/$loss.metrics.jsonl
done
python - $O <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
for loss in ("cross_entropy", "fused_linear_ce"):
    recs = [json.loads(l) for l in (out / f"{loss}.metrics.jsonl").read_text().splitlines() if l.strip()]
    steps = [r for r in recs if "tokens_per_second" in r and r.get("step", 0) >= 4]
    tps = statistics.median(r["tokens_per_second"] for r in steps)
    print(loss, "median tokens/s (steps 4-9):", round(tps), "peak GiB:", round(max(r.get("peak_memory_gib", 0) for r in recs), 1),
          "ac:", {k: round(v, 2) for k, v in recs[0].items() if k in ("ac_peak_gib", "ac_recomputed_gib", "ac_budget_gib")})
PY
