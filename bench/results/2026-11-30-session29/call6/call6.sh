# One H200: the trace of llama3 8B cut to 16 layers as one rank of dp_shard 2 (fake communication, selective AC, the
# step run as FX), with and without the in-graph optimizer, timed, then under cProfile.
O=$1
flags="--model.name llama3 --model.flavor 8B --model.n_layers 16 --training.seq_len 8192 --training.batch_size 2 --parallelism.dp_shard 2 --comm.mode fake --comm.fake_world_size 2 --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2 --compile.inductor_compilation none --training.random_tokens --training.steps 1"
for prof in "" "--profile"; do
  for opt in "" "--compile.optimizer_in_graph"; do
    echo "== ${prof:-timed} ${opt:-default}" >> $O/trace.txt
    timeout 150 python bench/results/2026-11-30-session29/call6/trace_profile.py $prof $flags $opt --job.dump_folder /tmp/tp 2>&1 | grep -v "^\s*$" | grep -v "graph-trainer\] \(step\|pass\|Loading\|Warmup\|fake\|Error running\)" >> $O/trace.txt
  done
done
