# One H200: `configs/llama3_70b.toml` as rank 0 of dp_shard 32 (fake communication) cold, after `reshard_after_forward`
# names its copies apart (call 3: torch 2.11 counted 4.3 s naming them); then one whole cold start of it under
# cProfile (one step), the functions with the most own time: what else torch 2.11 spends the host's start on.
#   bash bench/results/2026-12-02-session35/call4/call4.sh $OUT
O=$1
timeout 200 python bench/run.py --suite scale --groups "70B dp32" --only "gt production config" --timeout 180 --out $O/f --runs-dir /tmp/runs35f --bytecode-cache > $O/f.txt 2>&1; echo "f rc $?"
grep -E "^\| 70B" $O/f.txt | head -4
A="--config configs/llama3_70b.toml --training.batch_size 32 --training.steps 1 --training.random_tokens --comm.mode fake --comm.fake_world_size 32 --parallelism.dp_shard 32"
timeout 180 python bench/start_profile.py $O/start.prof train $A --job.dump_folder /tmp/p70c > $O/start.txt 2>&1; echo "profiled start rc $?"
grep -E "pass |traced the" $O/start.txt | cut -c1-120
python -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('tottime').print_stats(25)" $O/start.prof | grep -v "^$" | cut -c1-180
cd /tmp && tar czf $O/runs.tgz runs35f/*/metrics.jsonl runs35f/*/log.txt
