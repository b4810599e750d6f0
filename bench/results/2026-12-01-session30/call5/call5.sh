# 2 x H200, real NCCL. (a, b) the production config placed by our solver against the same config placed by hand,
# 8B-16L and 1B at dp_shard 2: session 29's call 7 again, after the bucketing of the replicated gradients the in-graph
# update reads (9be4a0a; the cost model said 24.5 -> 4.6 ms exposed). (c) 8B-16L pp 2 Interleaved1F1B, torchtitan
# compile beside ours (balanced split), both profiled: where the ~50 ms of busy time the interleaving adds go
# (bench/results/2026-12-01-session30, call 4).
#   bash bench/results/2026-12-01-session30/call5/call5.sh $OUT
O=$1
run() {  # groups, runs, name, timeout
  timeout $4 python bench/run.py --suite multi --gpus 2 --groups "$1" --only "$2" --steps 8 --timeout 100 --out $O/$3 --runs-dir /tmp/runs_s30c5$3 --bytecode-cache > $O/$3.out 2>&1
}
run "8B-16L dp2,8B-16L dp2 auto" "gt production config,gt production config auto-placed" a 170
run "1B dp2,1B dp2 auto" "gt production config,gt production config auto-placed" b 150
run "8B-16L pp2 Interleaved1F1B" "titan compile,gt full balanced" c 200
cd /tmp && for f in runs_s30c5?/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done
tar czf $O/runs.tgz $(ls -d runs_s30c5?/*/metrics.jsonl runs_s30c5?/*/log.txt runs_s30c5?/*/prediction.json runs_s30c5?/*/placements.json 2>/dev/null)
tar czf $O/traces.tgz $(ls -d runs_s30c5c/*/profile/trace.json runs_s30c5c/*/profile_traces/*/rank*_trace.json 2>/dev/null)
cd $O && for x in a b c; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b c && rm -rf a b c
