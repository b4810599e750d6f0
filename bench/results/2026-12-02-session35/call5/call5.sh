# One H200: a second round of calls 1-2's 8B pairs on the code of 6c5feab: `configs/llama3_8b.toml` as rank 0 of
# dp_shard 8 and of dp_shard 4 x tp 2, each beside torchtitan compile, torchtitan first this time.
#   bash bench/results/2026-12-02-session35/call5/call5.sh $OUT
O=$1
for g in "8B dp8:g" "8B dp4 tp2:h"; do
  timeout 170 python bench/run.py --suite scale --groups "${g%%:*}" --only "titan compile,gt production config" --timeout 160 --out $O/${g##*:} --runs-dir /tmp/runs35${g##*:} --bytecode-cache > $O/${g##*:}.txt 2>&1
  echo "${g##*:} rc $?"; grep -E "^\| 8B" $O/${g##*:}.txt | head -4
done
cd /tmp && tar czf $O/runs.tgz runs35?/*/metrics.jsonl runs35?/*/log.txt
