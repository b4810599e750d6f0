# One H200, fake communication (rank 0 of dp_shard 2): call 1's fused-loss step at a 40 GiB budget peaked at 41.2 GiB
# active where the policy's simulation with the collective schedule said 39.82. The allocator's snapshot at the peak,
# the traced step as the GPU traced it (the trace cache's entry: cuDNN attention, which a CPU trace does not have) so
# that the simulation can be replayed on a CPU against the snapshot, and the graph dumps.
O=$1
touch /tmp/s27c2_start
CUDA_VISIBLE_DEVICES=0 timeout 200 python -m graph_trainer train --comm.mode fake --comm.fake_world_size 2 --parallelism.dp_shard 2 \
  --model.flavor 8B --model.n_layers 16 --training.seq_len 8192 --training.batch_size 2 --training.random_tokens \
  --training.no-deterministic --training.steps 4 --metrics.log_freq 1 --compile.mode aot_fx_trace --compile.inductor_compilation full \
  --activation_checkpoint.mode memory_budget --activation_checkpoint.memory_budget 40GiB --training.loss fused_linear_ce \
  --profiling.memory_snapshot --profiling.start_step 3 --profiling.steps 1 --compile.dump_graphs --job.dump_folder /tmp/s27c2/fused40 > $O/fused40.log 2>&1
mkdir -p $O/fused40 && cd /tmp/s27c2/fused40 && cp metrics.jsonl profile/memory_peak.json $O/fused40/
tar czf $O/fused40/traces.tgz $(find . -path "*traces*" -name "*.bin") && tar czf $O/fused40/graphs.tgz graphs
find /tmp/torchinductor_root -name "*.py" -newer /tmp/s27c2_start -size +20k | head -50 > $O/fused40/inductor_files.txt
tar czf $O/fused40/inductor_code.tgz $(cat $O/fused40/inductor_files.txt) 2>/dev/null; ls -la $O/fused40
