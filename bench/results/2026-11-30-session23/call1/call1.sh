# 2 x H200, real NCCL, bf16 storage on both sides, llama3 8B cut to 16 layers, pp 2, 8 microbatches of 1 x 4096:
# each rank's compile workers lent to all its stage graphs (compile_workers.lent), the graphs compiled by pieces;
# a: Interleaved1F1B, b: 1F1B, each beside torchtitan compile
O=$1
timeout 200 python bench/run.py --suite multi --gpus 2 --groups "8B-16L pp2 Interleaved1F1B" --only "gt full balanced,titan compile" --steps 8 --timeout 120 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache > $O/a.out 2>&1
timeout 200 python bench/run.py --suite multi --gpus 2 --groups "8B-16L pp2 1F1B" --only "gt full balanced,titan compile" --steps 8 --timeout 120 --out $O/b --runs-dir /tmp/runs_b --bytecode-cache > $O/b.out 2>&1
cd /tmp && for f in runs_[ab]/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_[ab]/*/metrics.jsonl runs_[ab]/*/log.txt 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
