# 2 x H200, real NCCL, bf16 storage: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192 a rank. Call 5's fastest run
# (the memory policy at 40 GiB with the fused linear + cross-entropy loss) peaked 3.0 GiB over its budget and
# torchtitan's 39.9 GiB: the same under budgets of 37 and 36 GiB, beside torchtitan compile
O=$1
timeout 300 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt full memory_budget 37GiB fused loss,gt full memory_budget 36GiB fused loss" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s24c6 --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_s24c6/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s24c6/*/metrics.jsonl runs_s24c6/*/log.txt runs_s24c6/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
