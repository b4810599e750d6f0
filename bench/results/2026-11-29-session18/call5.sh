# one H200: ops nothing reads left out of the pieces; the 8B's in-graph optimizer cold start beside torchtitan compile
O=$1
G="python -m graph_trainer train --training.steps 6 --compile.mode aot_fx_trace --compile.inductor_compilation full --metrics.log_freq 1 --model.flavor debugmodel_flex_attn --model.n_layers 8"
run() { n=$1; shift; TORCHINDUCTOR_CACHE_DIR=/tmp/ic_$n TRITON_CACHE_DIR=/tmp/tc_$n timeout 150 "$@" --job.dump_folder /tmp/r_$n > $O/$n.log 2>&1; echo "$n rc=$?"; cp /tmp/r_$n/metrics.jsonl $O/$n.jsonl; }
run flex_workers $G
run flex_rank $G --compile.compile_workers 0
python3 - $O <<'PY'
import json, sys
d = sys.argv[1]
A = [json.loads(l) for l in open(f"{d}/flex_workers.jsonl")]; B = [json.loads(l) for l in open(f"{d}/flex_rank.jsonl")]
print("flex workers vs rank: losses equal", [x["loss"] for x in A] == [x["loss"] for x in B], "grad norms equal", [x["grad_norm"] for x in A] == [x["grad_norm"] for x in B], [x["loss"] for x in A])
PY
timeout -k 5 400 python bench/run.py --suite scale --groups "8B dp8" --only "titan compile,gt aot_fx_trace full,gt full + optimizer_in_graph" --steps 6 --timeout 150 --out $O/scale --runs-dir /tmp/runs --bytecode-cache 2>&1 | tail -2
grep -h "compile workers\|pass inductor_decomposition\|cannot store" /tmp/runs/*optimizer_in_graph/log.txt | cut -c1-200
cd /tmp/runs && find . \( -name metrics.jsonl -o -name log.txt -o -name config.toml \) -not -path "*pycache*" | tar czf $O/scale/runs.tgz -T -
cd $O && tar czf flex.tgz *.log *.jsonl && rm -f *.log *.jsonl scale/*.png
