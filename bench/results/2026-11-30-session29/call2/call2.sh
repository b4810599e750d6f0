# 2 x H200, real NCCL. The decided step (capture/step_cache.py): a restart runs the step its first start's passes and
# compile made, without the trace or a pass; every rank agrees first. torchtitan compile, our default cold, and our
# default started again on the cold run's cache: llama3 8B cut to 16 layers at dp_shard 2 (1 x 8192 a rank), 1B at
# dp_shard 2 (2 x 4096 a rank).
O=$1
run() {  # group, runs, name, timeout
  timeout $4 python bench/run.py --suite multi --gpus 2 --groups "$1" --only "$2" --steps 8 --timeout 100 --out $O/$3 --runs-dir /tmp/runs_s29c2$3 --bytecode-cache > $O/$3.out 2>&1
}
run "8B-16L dp2" "titan compile,gt aot_fx_trace full,gt full restart" a 200
run "1B dp2" "titan compile,gt aot_fx_trace full,gt full restart" b 170
cd /tmp && for f in runs_s29c2?/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s29c2?/*/metrics.jsonl runs_s29c2?/*/log.txt runs_s29c2?/*/prediction.json 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
