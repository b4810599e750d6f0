# 2 x H200, real NCCL, bf16 storage: DeepSeek V3 16B cut to 6 layers, dp_shard 2 x ep 2, 2 x 4096 a rank, ours alone:
# the cost model's exposed time by collective kind (prediction.json) beside the profile's; rank 0's trace comes back
# (gzip) to read each all-to-all's kernel time against its size
O=$1
timeout 200 python bench/run.py --suite multi --gpus 2 --groups "DeepSeek 16B-6L dp2 ep2" --only "gt aot_fx_trace full" --steps 8 --timeout 130 --out $O/a --runs-dir /tmp/runs_c3 --bytecode-cache > $O/a.out 2>&1
gzip -c /tmp/runs_c3/*/profile/trace.json > $O/trace.json.gz
cp /tmp/runs_c3/*/prediction.json $O/
cd /tmp && for f in runs_c3/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz runs_c3/*/metrics.jsonl runs_c3/*/log.txt
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
