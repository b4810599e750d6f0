# 2 x H200, real NCCL, bf16 storage on both sides: DeepSeek V3 16B cut to 6 layers, dp_shard 2 x ep 2, 2 x 4096 a rank;
# the link probe times all-to-alls on the expert-parallel dimension (parallel/links.probe), which the cost model's
# prediction now prices them with; beside torchtitan compile
O=$1
timeout 280 python bench/run.py --suite multi --gpus 2 --groups "DeepSeek 16B-6L dp2 ep2" --only "gt aot_fx_trace full,titan compile" --steps 8 --timeout 130 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_a/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_a/*/metrics.jsonl runs_a/*/log.txt runs_a/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
