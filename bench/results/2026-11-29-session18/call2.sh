# one H200: DeepSeek V3 16B's cold start with its pieces' times; FlexAttention pieces compiled by workers or the rank; pieces against whole on GPU
O=$1
G="python -m graph_trainer train --training.steps 6 --compile.mode aot_fx_trace --compile.inductor_compilation full --metrics.log_freq 1"
run() { n=$1; shift; TORCHINDUCTOR_CACHE_DIR=/tmp/ic_$n TRITON_CACHE_DIR=/tmp/tc_$n timeout 150 "$@" --job.dump_folder /tmp/r_$n > $O/$n.log 2>&1; echo "$n rc=$?"; cp /tmp/r_$n/metrics.jsonl $O/$n.jsonl; }
run flex_workers $G --model.flavor debugmodel_flex_attn --model.n_layers 8
run flex_rank $G --model.flavor debugmodel_flex_attn --model.n_layers 8 --compile.compile_workers 0
run dense_pieces $G --model.n_layers 8
run dense_whole $G --model.n_layers 8 --compile.block_reuse false
TORCHINDUCTOR_CACHE_DIR=/tmp/ic_ds TRITON_CACHE_DIR=/tmp/tc_ds timeout 200 python -m graph_trainer train --job.dump_folder /tmp/r_ds --model.name deepseek_v3 --model.flavor 16B --training.seq_len 4096 --training.batch_size 32 --training.steps 3 --training.random_tokens --training.no-deterministic --metrics.log_freq 1 --comm.mode fake --comm.fake_world_size 8 --parallelism.dp_shard 8 --parallelism.ep 8 --parallelism.moe_capacity_factor 2.0 --activation_checkpoint.mode none --compile.mode aot_fx_trace --compile.inductor_compilation full > $O/ds.log 2>&1; echo "ds rc=$?"; cp /tmp/r_ds/metrics.jsonl $O/ds.jsonl
python3 - $O <<'PY'
import json, sys
d = sys.argv[1]
for a, b in [("flex_workers", "flex_rank"), ("dense_pieces", "dense_whole")]:
    A = [json.loads(l) for l in open(f"{d}/{a}.jsonl")]; B = [json.loads(l) for l in open(f"{d}/{b}.jsonl")]
    print(a, b, "losses equal", [x["loss"] for x in A] == [x["loss"] for x in B], "grad norms equal", [x["grad_norm"] for x in A] == [x["grad_norm"] for x in B],
          "max |dloss|", max(abs(x["loss"] - y["loss"]) for x, y in zip(A, B)))
PY
grep -h "compile workers: piece\|pass inductor_decomposition\|pass full_inductor\|step:    1" $O/ds.log
cd $O && tar czf all.tgz *.log *.jsonl && rm -f *.log *.jsonl
