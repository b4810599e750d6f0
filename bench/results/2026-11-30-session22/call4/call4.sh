# 2 x H200, real NCCL: the profiled steps of ours and torchtitan compile come back whole (gzip), to compare their
# matmuls kernel by kernel: llama3 8B cut to 16 layers at dp_shard 2 (mixed bf16), and at tp 2 without async_tp
# (bf16 storage on both sides)
O=$1
timeout 260 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "gt aot_fx_trace full,titan compile" --steps 8 --timeout 120 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache > $O/a.out 2>&1
timeout 260 python bench/run.py --suite multi --gpus 2 --groups "8B-16L tp2" --only "gt full no async_tp,titan compile" --steps 8 --timeout 120 --out $O/b --runs-dir /tmp/runs_b --bytecode-cache > $O/b.out 2>&1
cd /tmp && for t in runs_[ab]/*/profile/trace.json runs_[ab]/*/profile_traces/iteration_*/rank0_trace.json; do
  [ -f "$t" ] && gzip -c "$t" > $O/$(echo ${t%%/profile*} | tr / -).trace.json.gz
done
for f in runs_[ab]/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_[ab]/*/metrics.jsonl runs_[ab]/*/log.txt 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
