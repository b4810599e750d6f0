# 2 x H200, real NCCL: llama3 8B cut to 16 layers at tp 2, bf16 storage on both sides: async_tp (now the default on GPUs
# with tp) with the gathers of a batch of one found, against the same step without it, beside torchtitan compile
O=$1
timeout 560 python bench/run.py --suite multi --gpus 2 --groups "8B-16L tp2" --only "gt aot_fx_trace full,titan compile,gt full no async_tp" --steps 8 --timeout 130 --out $O/c --runs-dir /tmp/runs_c --bytecode-cache > $O/c.out 2>&1
cd /tmp && for f in runs_c/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_c/*/metrics.jsonl runs_c/*/log.txt 2>/dev/null)
cd $O && grep -v "NCCL INFO" c.out > c.txt; rm -f c.out; tar czf suites.tgz c && rm -rf c
