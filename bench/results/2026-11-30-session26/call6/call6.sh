# 2 x H200, real NCCL, bf16 storage: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192 a rank. Call 5's Inductor code
# ran every chunk's log-softmax of the fused loss before the first chunk's gradients (three fp32 [2048, vocab] buffers
# alive at the peak of call 4's snapshot). Each chunk now reads its hidden states through losses.copy_after the previous
# chunk's weight-gradient sum. The memory policy with the fused loss at 40, 39.8 and 39.5 GiB beside torchtitan compile
# and our default; then the 40 GiB run's allocator snapshot (one GPU, fake communication, rank 0 of dp_shard 2).
O=$1
timeout 330 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt aot_fx_trace full,gt full memory_budget 40GiB fused loss,gt full memory_budget 39.8GiB fused loss,gt full memory_budget 39.5GiB fused loss" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s26c6 --bytecode-cache > $O/a.out 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 150 python -m graph_trainer train --comm.mode fake --comm.fake_world_size 2 --parallelism.dp_shard 2 \
  --model.flavor 8B --model.n_layers 16 --training.seq_len 8192 --training.batch_size 2 --training.random_tokens \
  --training.no-deterministic --training.steps 4 --metrics.log_freq 1 --compile.mode aot_fx_trace --compile.inductor_compilation full \
  --activation_checkpoint.mode memory_budget --activation_checkpoint.memory_budget 40GiB --training.loss fused_linear_ce \
  --profiling.memory_snapshot --profiling.start_step 3 --profiling.steps 1 --job.dump_folder /tmp/s26c6/fused40 > $O/fused40.log 2>&1
mkdir -p $O/fused40 && cp /tmp/s26c6/fused40/metrics.jsonl /tmp/s26c6/fused40/profile/memory_peak.json $O/fused40/
cd /tmp && for f in runs_s26c6/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s26c6/*/metrics.jsonl runs_s26c6/*/log.txt runs_s26c6/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
