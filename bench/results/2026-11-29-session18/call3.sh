# one H200: FlexAttention masks as FX pieces; DeepSeek V3 16B cold start and restart beside torchtitan compile
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
timeout -k 5 440 python bench/run.py --suite scale --groups "DeepSeek 16B dp8 ep8" --only "gt aot_fx_trace full,titan compile,gt full restart" --steps 6 --timeout 200 --out $O/ds --runs-dir /tmp/runs --bytecode-cache 2>&1 | tail -3
grep -h "compile workers: piece\|pass inductor_decomposition" /tmp/runs/*gt_aot_fx_trace_full/log.txt
cd /tmp/runs && find . \( -name metrics.jsonl -o -name log.txt -o -name config.toml \) -not -path "*pycache*" | tar czf $O/ds/runs.tgz -T -
cd $O && tar czf flex.tgz *.log *.jsonl && rm -f *.log *.jsonl ds/*.png
