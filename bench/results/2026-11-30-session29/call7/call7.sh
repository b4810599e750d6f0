# 2 x H200, real NCCL: the production config placed by our solver (--compile.autoparallel) against the same config
# placed by hand (our best manual step), llama3 8B cut to 16 layers at dp_shard 2 and 1B at dp_shard 2.
O=$1
run() {  # groups, runs, name, timeout
  timeout $4 python bench/run.py --suite multi --gpus 2 --groups "$1" --only "$2" --steps 8 --timeout 100 --out $O/$3 --runs-dir /tmp/runs_s29c7$3 --bytecode-cache > $O/$3.out 2>&1
}
run "8B-16L dp2,8B-16L dp2 auto" "gt production config,gt production config auto-placed" a 170
run "1B dp2,1B dp2 auto" "gt production config,gt production config auto-placed" b 150
cd /tmp && for f in runs_s29c7?/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s29c7?/*/metrics.jsonl runs_s29c7?/*/log.txt runs_s29c7?/*/prediction.json runs_s29c7?/*/placements.json 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
