# 2 x H200, real NCCL: the host time of torch's fused symmetric-memory ops at 8B-16L tp 2's shapes against their
# device time (symm_mem_host.py), then one profiled run of ours at 8B-16L tp 2 whose trace comes back (gzip)
O=$1
timeout 120 torchrun --nproc-per-node 2 bench/results/2026-11-30-session22/call3/symm_mem_host.py > $O/host.txt 2>&1
timeout 200 python bench/run.py --suite multi --gpus 2 --groups "8B-16L tp2" --only "gt aot_fx_trace full" --steps 8 --timeout 120 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache > $O/a.out 2>&1
gzip -c /tmp/runs_a/*/profile/trace.json > $O/trace.json.gz
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; grep -v "NCCL INFO" host.txt > h.txt; mv h.txt host.txt; rm -rf a
