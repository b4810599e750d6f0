# 2 x H200, real NCCL, bf16 storage: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192 a rank. Call 6's snapshot put the
# fused-loss step's peak at the start of backward, in the final norm's and the output projection's reduce-scatter
# bucket (a 2 GiB fp32 concatenation of their gradients). Parameters outside the blocks are now buckets of one, issued
# and waited for together as one block's. torchtitan compile, our default, the memory policy at 40 GiB with the fused
# loss, and that run's allocator snapshot (one GPU, fake communication, rank 0 of dp_shard 2).
O=$1
timeout 210 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt aot_fx_trace full,gt full memory_budget 40GiB fused loss" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s26c7 --bytecode-cache > $O/a.out 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 100 python -m graph_trainer train --comm.mode fake --comm.fake_world_size 2 --parallelism.dp_shard 2 \
  --model.flavor 8B --model.n_layers 16 --training.seq_len 8192 --training.batch_size 2 --training.random_tokens \
  --training.no-deterministic --training.steps 4 --metrics.log_freq 1 --compile.mode aot_fx_trace --compile.inductor_compilation full \
  --activation_checkpoint.mode memory_budget --activation_checkpoint.memory_budget 40GiB --training.loss fused_linear_ce \
  --profiling.memory_snapshot --profiling.start_step 3 --profiling.steps 1 --job.dump_folder /tmp/s26c7/fused40 > $O/fused40.log 2>&1
mkdir -p $O/fused40 && cp /tmp/s26c7/fused40/metrics.jsonl /tmp/s26c7/fused40/profile/memory_peak.json $O/fused40/
cd /tmp && for f in runs_s26c7/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s26c7/*/metrics.jsonl runs_s26c7/*/log.txt runs_s26c7/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
