# 2 x H200, real NCCL, bf16 storage on both sides: llama3 8B cut to 16 layers at tp 2. async_tp lowered through
# symmetric memory (the default) against its chunked lowering through NCCL collectives (2 and 4 slices of each rank's
# rows), beside torchtitan compile; where each profiled step's compute stream sat idle (bench/idle_gaps.py)
O=$1
timeout 420 python bench/run.py --suite multi --gpus 2 --groups "8B-16L tp2" --only "gt aot_fx_trace full,gt full async_tp chunked 2,gt full async_tp chunked 4,titan compile" --steps 8 --timeout 120 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache > $O/a.out 2>&1
for t in /tmp/runs_a/*/profile/trace.json /tmp/runs_a/*/profile_traces/iteration_*/rank0_trace.json; do
  [ -f "$t" ] && { echo "== $t"; python bench/idle_gaps.py "$t" --top 12; python bench/kernel_mix.py "$t"; } >> $O/a_gaps.txt 2>&1
done
cd /tmp && for f in runs_a/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_a/*/metrics.jsonl runs_a/*/log.txt 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
