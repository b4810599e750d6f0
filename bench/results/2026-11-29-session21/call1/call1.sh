# 2 x H200, real NCCL: llama3 8B cut to 16 layers at tp 2, bf16 storage on both sides (torchtitan has no mixed precision
# for TP without FSDP), torchtitan compile with and without its async TP beside ours with and without async_tp
O=$1
timeout 560 python bench/run.py --suite multi --gpus 2 --groups "8B-16L tp2" --only "titan compile,gt full async_tp,titan compile async TP,gt aot_fx_trace full" --steps 8 --timeout 130 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_a/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_a/*/metrics.jsonl runs_a/*/log.txt 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
