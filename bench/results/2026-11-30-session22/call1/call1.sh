# 2 x H200, real NCCL, bf16 storage on both sides. a: llama3 8B cut to 16 layers at tp 2, ours (default: async_tp) beside
# torchtitan compile: the cold start with the compile workers importing symmetric memory, and where each profiled
# step's compute stream sat idle (bench/idle_gaps.py). b: pp 2, Interleaved1F1B, 8 microbatches of 1 x 4096, the
# traced stages recomputing what selective AC wraps: torchtitan compile, ours balanced and on torchtitan's split.
O=$1
timeout 200 python bench/run.py --suite multi --gpus 2 --groups "8B-16L tp2" --only "gt aot_fx_trace full,titan compile" --steps 8 --timeout 120 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache > $O/a.out 2>&1
for t in /tmp/runs_a/*/profile/trace.json /tmp/runs_a/*/profile_traces/iteration_*/rank0_trace.json; do
  [ -f "$t" ] && { echo "== $t"; python bench/idle_gaps.py "$t" --top 12; python bench/kernel_mix.py "$t"; } >> $O/a_gaps.txt 2>&1
done
timeout 330 python bench/run.py --suite multi --gpus 2 --groups "8B-16L pp2 Interleaved1F1B" --only "titan compile,gt full balanced,gt aot_fx_trace full" --steps 8 --timeout 140 --out $O/b --runs-dir /tmp/runs_b --bytecode-cache > $O/b.out 2>&1
cd /tmp && for f in runs_a/*/log.txt runs_b/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_[ab]/*/metrics.jsonl runs_[ab]/*/log.txt 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
