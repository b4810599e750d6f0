# 2 x H200, real NCCL, bf16 storage on both sides. The link probe now times its calls on the device (queued behind a
# sleep, parallel/links.HOLD_CYCLES): a: DeepSeek V3 16B cut to 6 layers, dp_shard 2 x ep 2, 2 x 4096 a rank, the cost
# model's exposed all-to-all against the profile's; b: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192 (its overlap
# schedule planned on the new link figures); each beside torchtitan compile
O=$1
timeout 260 python bench/run.py --suite multi --gpus 2 --groups "DeepSeek 16B-6L dp2 ep2" --only "gt aot_fx_trace full,titan compile" --steps 8 --timeout 130 --out $O/a --runs-dir /tmp/runs_c4a --bytecode-cache > $O/a.out 2>&1
timeout 200 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "gt aot_fx_trace full,titan compile" --steps 8 --timeout 100 --out $O/b --runs-dir /tmp/runs_c4b --bytecode-cache > $O/b.out 2>&1
cd /tmp && for f in runs_c4[ab]/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_c4[ab]/*/metrics.jsonl runs_c4[ab]/*/log.txt runs_c4[ab]/*/prediction.json 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
