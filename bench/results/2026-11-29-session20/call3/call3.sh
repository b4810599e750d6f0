# 2 x H200, real NCCL: DeepSeek V3 16B-6L dp_shard 2 x ep 2 with the memory policy at torchtitan compile's peak and with
# ep_overlap, beside torchtitan compile; the 1B at dp_shard 2 again, in the other order (embedding gathered, read in place)
O=$1
timeout 330 python bench/run.py --suite multi --gpus 2 --groups "DeepSeek 16B-6L dp2 ep2" --only "gt aot_fx_trace full,titan compile,gt full memory_budget 30GiB,gt full ep_overlap" --steps 8 --timeout 85 --out $O/c --runs-dir /tmp/runs_c --bytecode-cache > $O/c.out 2>&1
timeout 150 python bench/run.py --suite multi --gpus 2 --groups "1B dp2" --only "gt full embedding gather,gt aot_fx_trace full,titan compile" --steps 8 --timeout 60 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_*/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_*/*/metrics.jsonl runs_*/*/log.txt 2>/dev/null)
cd $O && for x in a c; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a c && rm -rf a c
