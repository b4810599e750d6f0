# 2 x H200, real NCCL: the 1B production config auto-placed again, with replicated parameters' gradient all-reduces
# bucketed per block under the in-graph optimizer (passes/collectives.py read_by_update); the last of the session's
# device time, one run (against call 7's runs across calls).
O=$1
timeout 120 python bench/run.py --suite multi --gpus 2 --groups "1B dp2 auto" --only "gt production config auto-placed" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s29c9 --bytecode-cache > $O/a.out 2>&1
grep -v "NCCL INFO" $O/a.out > $O/a.txt; rm -f $O/a.out
cd /tmp && tar czf $O/runs.tgz runs_s29c9/*/metrics.jsonl runs_s29c9/*/prediction.json
cd $O && tar czf suites.tgz a && rm -rf a
