# 2 x H200, real NCCL, bf16 storage: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192 a rank. The memory policy now
# plans with what the collective schedule holds (it runs the backend's later passes on a copy of its rewrite and plans
# again with the bytes they held as each op ran): torchtitan compile, our default, and the fused-loss step at 40 and
# 39.5 GiB budgets (session 26: 41.66 and 41.20 GiB peak active at those budgets).
O=$1
timeout 330 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt aot_fx_trace full,gt full memory_budget 40GiB fused loss,gt full memory_budget 39.5GiB fused loss" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s27c1 --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_s27c1/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s27c1/*/metrics.jsonl runs_s27c1/*/log.txt runs_s27c1/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
