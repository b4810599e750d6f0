# 2 x H200, real NCCL: llama3 8B cut to 16 layers, pp 2, 1F1B, 8 microbatches of 1 x 4096, bf16 storage on both sides,
# ours with the balanced split recomputing the blocks selective AC wraps (call 4's stage compile did not end in 150 s:
# attention was tagged for recomputation), beside torchtitan compile
O=$1
timeout 300 python bench/run.py --suite multi --gpus 2 --groups "8B-16L pp2 1F1B" --only "gt full balanced,titan compile" --steps 8 --timeout 140 --out $O/e --runs-dir /tmp/runs_e --bytecode-cache > $O/e.out 2>&1
cd /tmp && for f in runs_e/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_e/*/metrics.jsonl runs_e/*/log.txt 2>/dev/null)
cd $O && grep -v "NCCL INFO" e.out > e.txt; rm -f e.out; tar czf suites.tgz e && rm -rf e
