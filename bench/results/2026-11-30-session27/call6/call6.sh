# One H200, fake communication (rank 0 of dp_shard 2): call 5's fused-loss step at a 39 GiB budget (39.8 GiB peak
# active on 2 GPUs). Where it peaks now: the allocator's snapshot at the peak, and the traced step for a CPU replay.
O=$1
CUDA_VISIBLE_DEVICES=0 timeout 200 python -m graph_trainer train --comm.mode fake --comm.fake_world_size 2 --parallelism.dp_shard 2 \
  --model.flavor 8B --model.n_layers 16 --training.seq_len 8192 --training.batch_size 2 --training.random_tokens \
  --training.no-deterministic --training.steps 4 --metrics.log_freq 1 --compile.mode aot_fx_trace --compile.inductor_compilation full \
  --activation_checkpoint.mode memory_budget --activation_checkpoint.memory_budget 39GiB --training.loss fused_linear_ce \
  --profiling.memory_snapshot --profiling.start_step 3 --profiling.steps 1 --job.dump_folder /tmp/s27c6/fused39 > $O/fused39.log 2>&1
mkdir -p $O/fused39 && cd /tmp/s27c6/fused39 && cp metrics.jsonl profile/memory_peak.json $O/fused39/
