# 1 x H200, fake communication (rank 0 of dp_shard 2): call 4's 40 GiB fused-loss run again, 2 steps, for Inductor's
# code of the graph piece that holds the loss (the allocator snapshot found three chunks' fp32 [2048, vocab] buffers
# alive at the peak; the CPU's code of the same piece holds two)
O=$1
export TORCHINDUCTOR_CACHE_DIR=/tmp/s26c5/inductor
timeout 200 python -m graph_trainer train --comm.mode fake --comm.fake_world_size 2 --parallelism.dp_shard 2 \
  --model.flavor 8B --model.n_layers 16 --training.seq_len 8192 --training.batch_size 2 --training.random_tokens \
  --training.no-deterministic --training.steps 2 --metrics.log_freq 1 --compile.mode aot_fx_trace --compile.inductor_compilation full \
  --activation_checkpoint.mode memory_budget --activation_checkpoint.memory_budget 40GiB --training.loss fused_linear_ce \
  --job.dump_folder /tmp/s26c5/fused40 > $O/fused40.log 2>&1
grep -l "graph_trainer.add_product_" -r $TORCHINDUCTOR_CACHE_DIR --include=*.py | head -1 | xargs -I{} cp {} $O/loss_piece.py
