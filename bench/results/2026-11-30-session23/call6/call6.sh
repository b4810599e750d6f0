# 2 x H200, real NCCL: llama3 1B, dp_shard 2, 2 x 4096 a rank: its overlap schedule planned on the device-timed link
# probe (parallel/links.HOLD_CYCLES), beside torchtitan compile
O=$1
timeout 240 python bench/run.py --suite multi --gpus 2 --groups "1B dp2" --only "gt aot_fx_trace full,titan compile" --steps 10 --timeout 100 --out $O/a --runs-dir /tmp/runs_c6 --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_c6/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_c6/*/metrics.jsonl runs_c6/*/log.txt runs_c6/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
