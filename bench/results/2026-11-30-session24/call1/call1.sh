# 2 x H200, real NCCL, bf16 storage: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192, selective AC. The solver prices
# a parameter's collectives as hidden behind its unit's compute up to that compute (autoparallel/program.py, overlap
# rows), the copy of a transposed weight's shard, and a parameter view's gradient in the reduce dtype: auto-placed runs
# beside our manual one and torchtitan compile
O=$1
timeout 230 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt aot_fx_trace full" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s24c1 --bytecode-cache > $O/a.out 2>&1
timeout 300 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2 auto" --only "gt full auto-placed,gt autoparallel_backend auto-placed" --steps 8 --timeout 140 --out $O/b --runs-dir /tmp/runs_s24c1 --bytecode-cache > $O/b.out 2>&1
cd /tmp && for f in runs_s24c1/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s24c1/*/metrics.jsonl runs_s24c1/*/log.txt runs_s24c1/*/prediction.json runs_s24c1/*/placements.json 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
