# 2 x H200, real NCCL. Our profiler now starts a step before the recorded one (graph_trainer/profiling.py: a warm-up
# step it drops, as torchtitan's schedule does; the suite records the last step on both sides): does the exposed
# communication at the start of our profiled step (12.1 ms of 1B dp_shard 2's 17.7 in call 2) go? torchtitan compile
# beside our default on the 1B at dp_shard 2 and the production config on 8B cut to 16 layers at dp_shard 2.
O=$1
run() {  # group, runs, name, timeout
  timeout $4 python bench/run.py --suite multi --gpus 2 --groups "$1" --only "$2" --steps 8 --timeout 100 --out $O/$3 --runs-dir /tmp/runs_s29c4$3 --bytecode-cache > $O/$3.out 2>&1
}
run "1B dp2" "titan compile,gt aot_fx_trace full" a 150
run "8B-16L dp2" "titan compile,gt production config" b 170
cd /tmp && for f in runs_s29c4?/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s29c4?/*/metrics.jsonl runs_s29c4?/*/log.txt runs_s29c4?/*/prediction.json 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
