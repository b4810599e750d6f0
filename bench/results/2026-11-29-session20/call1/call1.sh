# 2 x H200, real NCCL. a: 8B-16L dp_shard 2 cold start with compile workers on a node of two ranks (auto starts none),
# beside torchtitan compile; b: 8B-16L tp 2, torchtitan compile with and without its async TP beside ours with async_tp
O=$1
timeout 250 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt full compile workers 8,gt aot_fx_trace full,gt full compile workers 4" --steps 6 --timeout 80 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache > $O/a.out 2>&1
timeout 290 python bench/run.py --suite multi --gpus 2 --groups "8B-16L tp2" --only "titan compile async TP,gt full async_tp,titan compile" --steps 6 --timeout 110 --out $O/b --runs-dir /tmp/runs_b --bytecode-cache > $O/b.out 2>&1
cd /tmp && tar czf $O/runs.tgz $(ls -d runs_*/*/metrics.jsonl runs_*/*/log.txt runs_*/*/*.log 2>/dev/null | head -200)
cd $O && grep -v "NCCL INFO" a.out > a.txt; grep -v "NCCL INFO" b.out > b.txt; rm -f a.out b.out; tar czf suites.tgz a b && rm -rf a b
