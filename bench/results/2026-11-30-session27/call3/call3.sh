# 2 x H200, real NCCL, bf16 storage: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192 a rank. The liveness simulation
# now holds a collective's input until its wait (call 2's snapshot had the output projection's 1.96 GiB fp32 gradient
# bucket live in the first block's backward, which the simulation freed at the reduce-scatter's issue). torchtitan
# compile, our default, and the fused-loss step at 40 and 39 GiB budgets.
O=$1
timeout 330 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt aot_fx_trace full,gt full memory_budget 40GiB fused loss,gt full memory_budget 39GiB fused loss" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s27c3 --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_s27c3/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s27c3/*/metrics.jsonl runs_s27c3/*/log.txt runs_s27c3/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
