# One H200: the production configs as shipped beside torchtitan compile, same call, fake communication: llama3 70B
# as rank 0 of dp_shard 32, DeepSeek V3 16B as rank 0 of dp_shard 8 x ep 8, llama3 8B as rank 0 of dp_shard 4 x tp 2.
#   bash bench/results/2026-12-02-session35/call2/call2.sh $OUT
O=$1
part() {  # suite, groups, runs, name, timeout
  timeout $5 python bench/run.py --suite $1 --groups "$2" --only "$3" --timeout 250 --out $O/$4 --runs-dir /tmp/runs35$4 --bytecode-cache > $O/$4.txt 2>&1
  echo "$4 rc $?"
}
part scale "70B dp32" "titan compile,gt production config" d 250
part scale "DeepSeek 16B dp8 ep8" "titan compile,gt production config" e 230
part scale "8B dp4 tp2" "titan compile,gt production config" c 110
cd /tmp && tar czf $O/runs.tgz $(ls -d runs35?/*/metrics.jsonl runs35?/*/log.txt runs35?/*/prediction.json 2>/dev/null)
