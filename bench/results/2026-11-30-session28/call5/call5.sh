# 2 x H200, real NCCL: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192 a rank. configs/llama3_8b.toml as shipped
# (the memory policy filling the device, the in-graph optimizer), with and without the fused loss, beside torchtitan
# compile (selective AC).
O=$1
timeout 250 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt production config,gt production config fused loss" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s28c5 --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_s28c5/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s28c5/*/metrics.jsonl runs_s28c5/*/log.txt runs_s28c5/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
