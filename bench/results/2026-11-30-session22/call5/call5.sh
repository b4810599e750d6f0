# 2 x H200, real NCCL, bf16 storage on both sides: llama3 8B cut to 16 layers, pp 2, Interleaved1F1B, 8 microbatches
# of 1 x 4096: each rank compiling both of its traced stages before its first schedule (call 1: at each stage's first
# microbatch), time to step 1 beside torchtitan compile
O=$1
timeout 300 python bench/run.py --suite multi --gpus 2 --groups "8B-16L pp2 Interleaved1F1B" --only "gt full balanced,titan compile" --steps 8 --timeout 150 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_a/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_a/*/metrics.jsonl runs_a/*/log.txt 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
