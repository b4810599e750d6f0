#!/usr/bin/env bash
# Cold starts of llama3 8B as one rank of dp_shard 8 (fake communication, one GPU) from two trees in turn, A B A B:
# this checkout (A) and a copy of it changed by the sed expression $1 applied to file $2 (B). Each run has empty
# Inductor and Triton caches and a compile cache of its own; prints the step-1 record's start-up figures and the
# median tokens/s of steps 4-8. Usage (after the wheels line of ../shared/device/wheels.sh):
#   bash bench/scripts/cold_start_ab.sh SED_EXPRESSION FILE
# (bench/results/2026-11-29-early-workers/call4-halves-ab has one such comparison).
A="--model.name llama3 --model.flavor 8B --training.seq_len 8192 --training.batch_size 8 --training.steps 8 --training.random_tokens --training.no-deterministic --metrics.log_freq 1 --comm.mode fake --comm.fake_world_size 8 --parallelism.dp_shard 8 --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2 --compile.mode aot_fx_trace --compile.inductor_compilation full"
B=/tmp/tree_b
rm -rf $B && mkdir -p $B && git ls-files -z | xargs -0 tar cf - | tar xf - -C $B && sed -i "$1" $B/$2
diff $2 $B/$2 && { echo "the sed expression changed nothing"; exit 2; }
python -c "import torchtitan.train, graph_trainer.trainer, graph_trainer.passes.compile_worker_process"
for run in a1:$PWD b1:$B a2:$PWD b2:$B; do
  name=${run%%:*}; tree=${run#*:}; d=/tmp/ab_$name
  rm -rf $d && mkdir -p $d
  (cd $tree && PYTHONPATH=$tree:$PYTHONPATH TORCHINDUCTOR_CACHE_DIR=$d/ic TRITON_CACHE_DIR=$d/tc python -m graph_trainer train $A --job.dump_folder $d > $OUT/$name.log 2>&1)
  echo "== $name ($tree) rc $?"
  python3 -c "
import json, statistics; rs=[json.loads(l) for l in open('$d/metrics.jsonl')]; r=rs[0]
print({k: round(v,1) if isinstance(v,float) else v for k,v in r.items() if k.endswith('_s') or k in ('compiled_blocks','block_pieces','worker_compiled_pieces')})
print('tokens/s median of steps 4-8:', round(statistics.median(x['tokens_per_second'] for x in rs[3:])), 'peak GiB', round(max(x['peak_memory_gib'] for x in rs), 1))"
done
