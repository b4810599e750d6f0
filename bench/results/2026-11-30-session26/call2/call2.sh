# 1 x H200, fake communication (rank 0 of dp_shard 2): llama3 8B cut to 16 layers, 1 x 8192 a rank, the allocator's
# history over step 3 (--profiling.memory_snapshot): what is live at the peak of the memory policy's run at 40 GiB with
# the fused loss (42.98 GiB measured on 2 GPUs in call 1, 3.1 GiB over the policy's simulated peak) and of the default
# (selective AC every 2nd block, 38.34 GiB)
O=$1
common="--comm.mode fake --comm.fake_world_size 2 --parallelism.dp_shard 2 --model.flavor 8B --model.n_layers 16
  --training.seq_len 8192 --training.batch_size 2 --training.random_tokens --training.no-deterministic --training.steps 4
  --metrics.log_freq 1 --compile.mode aot_fx_trace --compile.inductor_compilation full
  --profiling.memory_snapshot --profiling.start_step 3 --profiling.steps 1"
run() {
  name=$1; shift
  timeout 240 python -m graph_trainer train $common --job.dump_folder /tmp/s26c2/$name "$@" > $O/$name.log 2>&1
  mkdir -p $O/$name && cp /tmp/s26c2/$name/metrics.jsonl /tmp/s26c2/$name/profile/memory_peak.json $O/$name/
}
run fused40 --activation_checkpoint.mode memory_budget --activation_checkpoint.memory_budget 40GiB --training.loss fused_linear_ce
run selective --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2
