# 2 x H200, real NCCL: the cold start of llama3 8B cut to 16 layers at dp_shard 2 with and without the in-graph
# optimizer (issue 32: it may add at most 20% to the cold compile), two rounds in opposite orders, each run in a runs
# folder of its own (nothing cached).
O=$1
run() {  # runs, name
  timeout 150 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "$1" --steps 6 --timeout 100 --out $O/$2 --runs-dir /tmp/runs_s29c8$2 --bytecode-cache > $O/$2.out 2>&1
}
run "gt aot_fx_trace full,gt full optimizer_in_graph" a
run "gt full optimizer_in_graph,gt aot_fx_trace full" b
cd /tmp && for f in runs_s29c8?/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s29c8?/*/metrics.jsonl runs_s29c8?/*/log.txt 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
