# 2 x H200, real NCCL, bf16 storage: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192, selective AC. The solver now
# prices the contiguous copy of a transposed weight's shard before it is sent (autoparallel/planner._Value.contiguous)
# and stores the weights Shard(0) as SimpleFSDP does (Shard(1) before); auto-placed runs beside our manual one
O=$1
timeout 400 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2,8B-16L dp2 auto" --only "gt aot_fx_trace full,gt full auto-placed,gt autoparallel_backend auto-placed" --steps 8 --timeout 150 --out $O/a --runs-dir /tmp/runs_c5 --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_c5/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_c5/*/metrics.jsonl runs_c5/*/log.txt runs_c5/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
