# 2 x H200, real NCCL, bf16 storage: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192 a rank. The per-block schedule
# now waits for each gradient reduction where the cost model expects it done (no later than the next reduction's
# issue, as before): the output projection's 1.96 GiB fp32 bucket, in flight through the first block's backward in
# calls 1-3, is freed inside it. torchtitan compile, our default (selective AC: its reductions move too), and the
# fused-loss step at 40 and 39 GiB budgets.
O=$1
timeout 330 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt aot_fx_trace full,gt full memory_budget 40GiB fused loss,gt full memory_budget 39GiB fused loss" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s27c4 --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_s27c4/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s27c4/*/metrics.jsonl runs_s27c4/*/log.txt runs_s27c4/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
