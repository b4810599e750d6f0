# the 8B (one rank of dp_shard 8, fake communication) beside torchtitan compile, two rounds in other orders
O=$1
python bench/run.py --suite scale --groups "8B dp8" --only "titan compile,gt aot_fx_trace full,gt full + optimizer_in_graph" --steps 6 --timeout 90 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache
python bench/run.py --suite scale --groups "8B dp8" --only "gt full + optimizer_in_graph,gt aot_fx_trace full,titan compile" --steps 6 --timeout 90 --out $O/b --runs-dir /tmp/runs_b --bytecode-cache
cd /tmp && tar czf $O/runs.tgz $(ls -d runs_a/*/metrics.jsonl runs_b/*/metrics.jsonl runs_a/*/log.txt runs_b/*/log.txt)
