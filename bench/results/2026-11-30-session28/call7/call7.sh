# 2 x H200, real NCCL, bf16 storage: llama3 8B cut to 16 layers, tp 2, 1 x 8192. torchtitan compile with its async TP;
# our step with the in-graph optimizer (the production configs'), without and with tp_reduce_overlap.
O=$1
timeout 240 python bench/run.py --suite multi --gpus 2 --groups "8B-16L tp2" --only "titan compile async TP,gt full optimizer_in_graph,gt full optimizer_in_graph tp_reduce_overlap" --steps 8 --timeout 90 --out $O/a --runs-dir /tmp/runs_s28c7 --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_s28c7/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s28c7/*/metrics.jsonl runs_s28c7/*/log.txt runs_s28c7/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
