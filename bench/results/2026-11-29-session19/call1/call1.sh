# sampled cold starts of the 8B (one rank of dp_shard 8), without and with the in-graph optimizer
O=$1; mkdir -p $O
python -c "import torchtitan.train, graph_trainer.trainer, graph_trainer.passes.compile_worker_process" >/dev/null 2>&1
A="--model.name llama3 --model.flavor 8B --training.seq_len 8192 --training.batch_size 8 --training.steps 3 --training.random_tokens --training.no-deterministic --metrics.log_freq 1 --comm.mode fake --comm.fake_world_size 8 --parallelism.dp_shard 8 --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2 --compile.mode aot_fx_trace --compile.inductor_compilation full"
for r in base opt; do
  X=""; [ $r = opt ] && X="--compile.optimizer_in_graph"
  D=/tmp/r_$r; rm -rf $D
  SAMPLES=$O/$r.samples TORCHINDUCTOR_CACHE_DIR=$D/ic TRITON_CACHE_DIR=$D/tc timeout 200 python bench/results/2026-11-29-session19/call1/sampled.py train --job.dump_folder $D $A $X > $O/$r.log 2>&1
  cp $D/metrics.jsonl $O/$r.jsonl
done
SAMPLES=$O/restart.samples TORCHINDUCTOR_CACHE_DIR=/tmp/r_base/ic TRITON_CACHE_DIR=/tmp/r_base/tc timeout 200 python bench/results/2026-11-29-session19/call1/sampled.py train --job.dump_folder /tmp/r_base $A > $O/restart.log 2>&1
cp /tmp/r_base/metrics.jsonl $O/restart.jsonl
cd $O && tar czf samples.tgz *.samples && rm *.samples
