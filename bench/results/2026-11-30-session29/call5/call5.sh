# 2 x H200, real NCCL: where the 1B at dp_shard 2 leaves 3.5% of its profiled step exposed (call 4): our default run by
# the multi suite, then exposed_intervals.py on rank 0's trace of its last step.
O=$1
timeout 150 python bench/run.py --suite multi --gpus 2 --groups "1B dp2" --only "gt aot_fx_trace full" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s29c5 --bytecode-cache > $O/a.out 2>&1
grep -v "NCCL INFO" $O/a.out > $O/a.txt; rm -f $O/a.out
python bench/results/2026-11-30-session29/call5/exposed_intervals.py /tmp/runs_s29c5/1B_dp2-gt_aot_fx_trace_full/profile/trace.json 30 > $O/exposed.txt
cd /tmp && tar czf $O/runs.tgz runs_s29c5/*/metrics.jsonl runs_s29c5/*/prediction.json
cd $O && tar czf suites.tgz a && rm -rf a
