# 2 x H200, real NCCL, bf16 storage: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192 a rank. torchtitan compile, our
# default and the fused-loss step at 39.5 GiB, each with torch's fused AdamW after the step and with the clip and update
# compiled into it (--compile.optimizer_in_graph).
O=$1
timeout 450 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt aot_fx_trace full,gt full optimizer_in_graph,gt full memory_budget 39.5GiB fused loss,gt full memory_budget 39.5GiB fused loss optimizer_in_graph" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s28c1 --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_s28c1/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s28c1/*/metrics.jsonl runs_s28c1/*/log.txt runs_s28c1/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
