# 2 x H200, real NCCL, bf16 storage on both sides: llama3 8B cut to 16 layers, tp 2, 1 x 8192, selective AC, ours
# (async_tp by default) on the device-timed link probe, beside torchtitan compile: a check that the probe's new figures
# left the tensor-parallel step where it was
O=$1
timeout 240 python bench/run.py --suite multi --gpus 2 --groups "8B-16L tp2" --only "gt aot_fx_trace full,titan compile" --steps 8 --timeout 110 --out $O/a --runs-dir /tmp/runs_c7 --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_c7/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_c7/*/metrics.jsonl runs_c7/*/log.txt runs_c7/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
