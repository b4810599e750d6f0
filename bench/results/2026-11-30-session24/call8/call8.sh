# 2 x H200, real NCCL, bf16 storage: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192 a rank, auto-placed with
# `autoparallel_backend` (0.970x our manual step in call 2), profiled: where its time goes beside the full-Inductor one
O=$1
timeout 200 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2 auto" --only "gt autoparallel_backend auto-placed" --steps 8 --timeout 120 --out $O/a --runs-dir /tmp/runs_s24c8 --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_s24c8/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s24c8/*/metrics.jsonl runs_s24c8/*/log.txt runs_s24c8/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
