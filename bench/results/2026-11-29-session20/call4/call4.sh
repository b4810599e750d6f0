# 2 x H200, real NCCL: 8B-16L dp_shard 2 again, in another order: torchtitan compile, the embedding gathered, read in
# place (auto, with auto's 4 compile workers a rank), and that job restarted from its compile cache
O=$1
timeout 300 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt full embedding gather,gt aot_fx_trace full,gt full restart" --steps 8 --timeout 75 --out $O/b --runs-dir /tmp/runs_b --bytecode-cache > $O/b.out 2>&1
cd /tmp && for f in runs_*/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_*/*/metrics.jsonl runs_*/*/log.txt 2>/dev/null)
cd $O && grep -v "NCCL INFO" b.out > b.txt; rm -f b.out; tar czf suites.tgz b && rm -rf b
