#!/usr/bin/env bash
# Where a cold start of llama3 8B as one rank of dp_shard 8 (fake communication, one GPU) goes, into $OUT:
# imports (python -X importtime, twice: the first writes the bytecode of freshly installed wheels), a CUDA context,
# one cold start as the job runs (`cold.log`, `cold.metrics.jsonl`: its step-1 record has `before_init_s`, the
# process's seconds before the trainer's clock), and the full compile without compile workers under cProfile
# (`compile.prof`, one process compiling every distinct piece in turn; cProfile slows the Python side about 2x).
# Usage (after the wheels line of ../shared/device/wheels.sh): bash bench/scripts/cold_start_breakdown.sh [extra flags]
A="--model.name llama3 --model.flavor 8B --training.seq_len 8192 --training.batch_size 8 --training.steps 2 --training.random_tokens --training.no-deterministic --metrics.log_freq 1 --comm.mode fake --comm.fake_world_size 8 --parallelism.dp_shard 8 --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2 --compile.mode aot_fx_trace --compile.inductor_compilation full $*"
for i in 1 2; do
  /usr/bin/time -f "%e s" python -X importtime -c "import graph_trainer.trainer, torchtitan.models.llama3" 2> $OUT/importtime$i.txt
  tail -1 $OUT/importtime$i.txt
done
/usr/bin/time -f "cuda context %e s" python -c "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
d=/tmp/cold_$RANDOM
TORCHINDUCTOR_CACHE_DIR=$d/ic TRITON_CACHE_DIR=$d/tc /usr/bin/time -f "cold run %e s" python -m graph_trainer train $A --job.dump_folder $d > $OUT/cold.log 2>&1
tail -1 $OUT/cold.log
cp $d/metrics.jsonl $OUT/cold.metrics.jsonl
d=/tmp/prof_$RANDOM
TORCHINDUCTOR_CACHE_DIR=$d/ic TRITON_CACHE_DIR=$d/tc timeout 300 python bench/start_profile.py $OUT/compile.prof --pass full_inductor_compilation \
  train $A --job.dump_folder $d --compile.compile_workers 0 > $OUT/compile.log 2>&1
echo "profiled compile rc $?"
