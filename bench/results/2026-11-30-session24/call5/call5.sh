# 2 x H200, real NCCL, bf16 storage: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192 a rank. The memory policy at
# torchtitan compile's measured peak (40 GiB) in place of selective AC, with and without the fused linear +
# cross-entropy loss, beside torchtitan compile and our default (selective AC every 2nd layer)
O=$1
timeout 400 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt aot_fx_trace full,gt full memory_budget 40GiB,gt full memory_budget 40GiB fused loss" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s24c5 --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_s24c5/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s24c5/*/metrics.jsonl runs_s24c5/*/log.txt runs_s24c5/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
