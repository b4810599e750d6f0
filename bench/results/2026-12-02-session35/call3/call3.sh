# One H200: where the 70B production config's `reshard_after_forward` pass spent 5.0 s on the GPU machine's host
# (call 2) when the same pass on the same graph traced on meta tensors takes 0.7 s on the CI machine: the pass under
# cProfile (bench/start_profile.py, the process ends after it), with the trace cache on (the default: a forked child
# pickles the traced graph while the pass runs) and off.
#   bash bench/results/2026-12-02-session35/call3/call3.sh $OUT
O=$1
A="--config configs/llama3_70b.toml --training.batch_size 32 --training.steps 2 --training.random_tokens --comm.mode fake --comm.fake_world_size 32 --parallelism.dp_shard 32"
timeout 150 python bench/start_profile.py $O/cache_on.prof --pass reshard_after_forward train $A --job.dump_folder /tmp/p70a > $O/cache_on.txt 2>&1; echo "cache on rc $?"
timeout 150 python bench/start_profile.py $O/cache_off.prof --pass reshard_after_forward train $A --compile.cache_dir off --job.dump_folder /tmp/p70b > $O/cache_off.txt 2>&1; echo "cache off rc $?"
for f in cache_on cache_off; do echo "== $f"; grep -E "traced the|pass reshard" $O/$f.txt
  python -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('cumulative').print_stats(22); s.sort_stats('tottime').print_stats(12)" $O/$f.prof | grep -v "^$" | cut -c1-180; done
