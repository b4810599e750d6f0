# One H200: the production configs as shipped beside torchtitan compile, same call (fake communication for the
# ranks of larger jobs): 8B as rank 0 of dp_shard 8 (with the selective-AC full step and the in-graph optimizer
# alone for reference), and the README's one-GPU 1B command.
#   bash bench/results/2026-12-02-session35/call1/call1.sh $OUT
O=$1
part() {  # suite, groups, runs, name, timeout
  timeout $5 python bench/run.py --suite $1 --groups "$2" --only "$3" --timeout 200 --out $O/$4 --runs-dir /tmp/runs35$4 --bytecode-cache > $O/$4.txt 2>&1
  echo "$4 rc $?"
}
part scale "8B dp8" "titan compile,gt production config,gt aot_fx_trace full,gt full + optimizer_in_graph" a 330
part h100 levers "titan compile,gt production config" b 150
cd /tmp && tar czf $O/runs.tgz $(ls -d runs35?/*/metrics.jsonl runs35?/*/log.txt runs35?/*/prediction.json 2>/dev/null)
