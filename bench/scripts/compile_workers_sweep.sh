#!/usr/bin/env bash
# Cold starts of llama3 8B as one rank of dp_shard 8 (fake communication, one GPU), one per WORKERS:THREADS argument:
# --compile.compile_workers WORKERS, TORCHINDUCTOR_COMPILE_THREADS=THREADS, each with empty Inductor and Triton caches
# and a compile cache of its own; prints each worker's seconds per piece (sorted) and the step-1 record's start-up times.
# Usage (after the wheels line of ../shared/device/wheels.sh): bash bench/scripts/compile_workers_sweep.sh 8:2 0:16
A="--model.name llama3 --model.flavor 8B --training.seq_len 8192 --training.batch_size 8 --training.steps 1 --training.random_tokens --training.no-deterministic --metrics.log_freq 1 --comm.mode fake --comm.fake_world_size 8 --parallelism.dp_shard 8 --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2 --compile.mode aot_fx_trace --compile.inductor_compilation full"
for cfg in "$@"; do
  w=${cfg%:*}; t=${cfg#*:}; d=/tmp/sweep_${w}_${t}_$RANDOM
  mkdir -p $d
  TORCHINDUCTOR_CACHE_DIR=$d/ic TRITON_CACHE_DIR=$d/tc TORCHINDUCTOR_COMPILE_THREADS=$t timeout 150 python -m graph_trainer train $A --job.dump_folder $d --compile.compile_workers $w > $d/log 2>&1
  echo "== workers $w threads $t rc $?"
  grep "compile workers: piece" $d/log | awk '{print $(NF-1)}' | sort -n | tr '\n' ' '; echo
  python3 -c "
import json; r=json.loads(open('$d/metrics.jsonl').readline()); print({k: round(v,1) if isinstance(v,float) else v for k,v in r.items() if k in ('time_to_first_step_s','trace_s','compile_workers_s','pass_inductor_decomposition_s','pass_full_inductor_compilation_s','worker_compiled_pieces','first_call_s')})"
done
