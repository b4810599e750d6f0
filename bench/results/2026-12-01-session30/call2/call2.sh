# One H200. (1) configs/llama3_8b.toml cold and restarted twice, with Python's bytecode compiled once beforehand;
# (2) the scale suite's 8B dp8 cold starts, torchtitan compile beside ours, two rounds in opposite orders.
#   bash bench/results/2026-12-01-session30/call2/call2.sh $OUT
O=$1
R=/tmp/runs
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=$R/pycache
python -c "import graph_trainer.trainer, graph_trainer.cli, graph_trainer.passes.compile_worker_process, torchtitan.train" > /dev/null 2>&1
mkdir -p $O/warm && python bench/results/2026-12-01-session30/call2/warm.py $O/warm
for order in "titan compile,gt aot_fx_trace full,gt full restart" "gt aot_fx_trace full,titan compile"; do
  n=$((n + 1))
  timeout 280 python bench/run.py --suite scale --groups "8B dp8" --only "$order" --steps 6 --timeout 100 \
    --out $O/round$n --runs-dir $R --bytecode-cache > $O/round$n.out 2>&1
  grep -h '^{' $O/round$n.out | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print('round $n', r['name'], 'launch to step 1', r.get('launch_to_first_step_s'), 'tokens/s', r.get('tokens_per_second'),
          {k: r.get(k) for k in ('before_init_s', 'init_s', 'trace_s', 'first_call_s', 'compile_s')})"
done
