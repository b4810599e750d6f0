# 2 x H200, real NCCL. The update pieces of the in-graph optimizer compiled with one launch configuration
# (passes/inductor.py, ONE_POINTWISE_CONFIG). Our default with and without --compile.optimizer_in_graph beside
# torchtitan compile: llama3 8B cut to 16 layers at dp_shard 2 (1 x 8192 a rank) and at tp 2 (against torchtitan
# with its async TP), DeepSeek V3 16B cut to 6 layers at dp_shard 2 x ep 2 (2 x 4096 a rank).
O=$1
run() {  # group, runs, name
  timeout $4 python bench/run.py --suite multi --gpus 2 --groups "$1" --only "$2" --steps 8 --timeout 100 --out $O/$3 --runs-dir /tmp/runs_s28c4$3 --bytecode-cache > $O/$3.out 2>&1
}
run "8B-16L dp2" "titan compile,gt aot_fx_trace full,gt full optimizer_in_graph" a 170
run "8B-16L tp2" "titan compile async TP,gt aot_fx_trace full,gt full optimizer_in_graph" b 170
run "DeepSeek 16B-6L dp2 ep2" "titan compile,gt aot_fx_trace full,gt full optimizer_in_graph" c 190
cd /tmp && for f in runs_s28c4?/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s28c4?/*/metrics.jsonl runs_s28c4?/*/log.txt runs_s28c4?/*/prediction.json 2>/dev/null)
cd $O && for x in a b c; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b c && rm -rf a b c
