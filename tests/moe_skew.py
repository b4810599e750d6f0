"""Routing skewed on purpose for the MoE drop tests: expert 0 wins every token's top-k choice, so with a
capacity factor the peer holding it overflows every step. Also a recorder of what each dispatch call
routed (eager only: a traced step runs no Python), and a torchrun entry point that applies both:

    python -m torch.distributed.run ... tests/moe_skew.py RECORD_DIR train ARGS...

writes `RECORD_DIR/rank<R>.pt` (one (scores, experts) pair per dispatch call, in call order); a
RECORD_DIR of `-` records nothing (for traced runs: recording would add ops to the graph)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from graph_trainer.parallel import expert_parallel

_ROUTE = expert_parallel.route
_DISPATCH = expert_parallel.dispatch_and_combine
HOT_BIAS = 1.0
"""Added to expert 0's selection score (scores lie in (0, 1)): it is always chosen; the routing
weights themselves are left alone."""


def hot_route(router, x, gate_weight, gate_bias, expert_bias):
    hot = torch.zeros(gate_weight.shape[0], device=x.device)
    hot[0] = HOT_BIAS
    return _ROUTE(router, x, gate_weight, gate_bias, hot if expert_bias is None else expert_bias + hot)


def install(setattr_, calls: list | None) -> None:
    """Skew the routing (and record every dispatch call into `calls` unless None) through `setattr_`,
    e.g. pytest's `monkeypatch.setattr`."""
    setattr_(expert_parallel, "route", hot_route)
    if calls is None:
        return

    def recording_dispatch(plan, x, scores, experts, *weights):
        calls.append((scores.detach().clone(), experts.clone()))
        return _DISPATCH(plan, x, scores, experts, *weights)

    setattr_(expert_parallel, "dispatch_and_combine", recording_dispatch)


if __name__ == "__main__":
    from graph_trainer.cli import main

    record_dir, argv = sys.argv[1], sys.argv[2:]
    calls = None if record_dir == "-" else []
    install(setattr, calls)
    code = main(argv)
    if calls is not None:
        Path(record_dir).mkdir(parents=True, exist_ok=True)
        torch.save(calls, Path(record_dir) / f"rank{os.environ.get('RANK', '0')}.pt")
    # As graph_trainer's own entry point: skip interpreter teardown, which gloo's threads can abort.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
