# One H200: the scale suite's 8B dp8 cold starts on this session's code, torchtitan compile beside ours and ours with
# the in-graph optimizer (issue 32: at most 1.2x the cold start without it), two rounds in opposite orders.
#   bash bench/results/2026-12-01-session30/call6/call6.sh $OUT
O=$1
for order in "titan compile,gt aot_fx_trace full,gt full + optimizer_in_graph" "gt full + optimizer_in_graph,gt aot_fx_trace full,titan compile"; do
  n=$((n + 1))
  timeout 280 python bench/run.py --suite scale --groups "8B dp8" --only "$order" --steps 12 --timeout 100 \
    --out $O/round$n --runs-dir /tmp/runs6 --bytecode-cache > $O/round$n.out 2>&1
  grep -h '^{' $O/round$n.out | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print('round $n', r['name'], 'launch to step 1', r.get('launch_to_first_step_s'), 'tokens/s', r.get('tokens_per_second'),
          {k: r.get(k) for k in ('before_init_s', 'init_s', 'trace_s', 'compile_s', 'compile_workers_s', 'first_call_s', 'optimizer_s', 'error')})"
done
rm -rf $O/round1/*.png $O/round2/*.png
