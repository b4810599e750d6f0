# 2 x H200, real NCCL: DeepSeek V3 16B-6L dp_shard 2 x ep 2, the memory policy at torchtitan compile's peak, a second round
O=$1
timeout 200 python bench/run.py --suite multi --gpus 2 --groups "DeepSeek 16B-6L dp2 ep2" --only "gt full memory_budget 30GiB,titan compile" --steps 8 --timeout 90 --out $O/c --runs-dir /tmp/runs_c --bytecode-cache > $O/c.out 2>&1
cd /tmp && for f in runs_*/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_*/*/metrics.jsonl runs_*/*/log.txt 2>/dev/null)
cd $O && grep -v "NCCL INFO" c.out > c.txt; rm -f c.out; tar czf suites.tgz c && rm -rf c
