# the in-graph optimizer's gradient norm run as FX: the 8B (one rank of dp_shard 8) cold, two rounds in other orders
O=$1
python bench/run.py --suite scale --groups "8B dp8" --only "gt full + optimizer_in_graph,titan compile,gt aot_fx_trace full" --steps 5 --timeout 90 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache > $O/a.out 2>&1
python bench/run.py --suite scale --groups "8B dp8" --only "gt aot_fx_trace full,gt full + optimizer_in_graph,titan compile" --steps 5 --timeout 90 --out $O/b --runs-dir /tmp/runs_b --bytecode-cache > $O/b.out 2>&1
cd /tmp && tar czf $O/runs.tgz $(ls -d runs_*/*/metrics.jsonl runs_*/*/log.txt)
cd $O && tar czf suites.tgz a b a.out b.out && rm -rf a b a.out b.out
