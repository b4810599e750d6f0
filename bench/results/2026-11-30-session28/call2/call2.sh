# One H200: Inductor's compile time of the in-graph optimizer's step scalars against one update (scalars.py); then the
# 8B-16L dp_shard 2 fused-loss step with the in-graph optimizer as one rank with fake communication, its compile
# workers' log naming each piece by its largest input.
O=$1
python bench/results/2026-11-30-session28/call2/scalars.py > $O/scalars.txt 2>&1
timeout 200 python -m graph_trainer train --job.dump_folder /tmp/c2 --model.name llama3 --model.flavor 8B --model.n_layers 16 --training.seq_len 8192 --training.batch_size 2 --training.steps 4 --training.random_tokens --training.no-deterministic --metrics.log_freq 1 --comm.mode fake --comm.fake_world_size 2 --parallelism.dp_shard 2 --activation_checkpoint.mode memory_budget --activation_checkpoint.memory_budget 39.5GiB --training.loss fused_linear_ce --compile.mode aot_fx_trace --compile.inductor_compilation full --compile.optimizer_in_graph > $O/fake.txt 2>&1
cp /tmp/c2/metrics.jsonl $O/
