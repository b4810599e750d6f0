# 2 x H200, real NCCL: how long the GPUs wait on the host between our steps (ahead.py: the step as the trainer runs it,
# two host syncs a step, against the same step queued with no read until the end), llama3 1B dp_shard 2 (2 x 4096 a
# rank) and 8B cut to 16 layers dp_shard 2 (1 x 8192, selective AC), each as the multi suite runs it, then the same
# with the in-graph optimizer.
O=$1
common="--training.random_tokens --training.no-deterministic --training.steps 1000 --parallelism.dp_shard 2"
one_b="--model.name llama3 --model.flavor 1B --training.seq_len 4096 --training.batch_size 4 --activation_checkpoint.mode none $common"
eight_b="--model.name llama3 --model.flavor 8B --model.n_layers 16 --training.seq_len 8192 --training.batch_size 2 --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2 $common"
for run in "1b:$one_b" "8b:$eight_b" "1b_in_graph:$one_b --compile.optimizer_in_graph" "8b_in_graph:$eight_b --compile.optimizer_in_graph"; do
  name=${run%%:*}; flags=${run#*:}
  echo "== $name" | tee -a $O/ahead.txt
  timeout 150 torchrun --nproc_per_node 2 bench/results/2026-11-30-session29/call3/ahead.py $flags --job.dump_folder /tmp/ahead_$name 2>&1 | grep -v "NCCL INFO" | grep "round\|Error\|error" | tee -a $O/ahead.txt
done
