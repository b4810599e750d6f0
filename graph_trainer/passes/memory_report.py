"""What the memory policy (memory_policy.py) chose, as the log line and the step-1 metrics record's
`ac_*` keys (`ctx.report["memory_policy"]`) show it."""

from __future__ import annotations

import logging

from ..units import GiB
from .recompute import Policy
from .registry import PassContext

logger = logging.getLogger("graph_trainer")


def log_policy(name: str, saved: int, baseline: int, recomputed: int, extra: str, tail: str, offloaded: str = "0 GiB") -> None:
    logger.info(
        f"memory policy {name}: activations saved {saved / GiB:.3f} GiB of {baseline / GiB:.3f}, recomputed "
        f"{recomputed / GiB:.3f} GiB{extra}, offloaded {offloaded}; {tail}"
    )


def report_policy(ctx: PassContext, saved: int, recomputed: int, budget: float | None, offloaded: int = 0,
                  **more: float) -> None:
    report = {"ac_saved_gib": saved / GiB, "ac_recomputed_gib": recomputed / GiB, "ac_offloaded_gib": offloaded / GiB,
              **more}
    if budget is not None:
        report["ac_budget_gib"] = budget / GiB
    ctx.report.setdefault("memory_policy", {}).update(report)


def report_train_step(ctx: PassContext, name: str, policy: Policy, recomputed: int, budget: float | None,
                      persistent: int, scheduled: int | None = None) -> None:
    """aot_fx_trace: the policy's figures, its simulated peaks with what the step holds besides the
    graph's own values (`persistent`), the peak once the backend's later passes have scheduled the
    collectives (`scheduled`, where the budget policy simulated them), and one warning when the step's
    peak stays over the budget."""
    peak, without = persistent + policy.peak_bytes, persistent + policy.baseline_peak_bytes
    more = {} if scheduled is None else {"ac_scheduled_peak_gib": scheduled / GiB}
    report_policy(ctx, policy.saved_bytes, recomputed, budget, policy.offloaded_bytes,
                  ac_baseline_gib=policy.baseline_bytes / GiB, ac_recompute_s=policy.recompute_s,
                  ac_offload_unhidden=policy.unhidden, ac_peak_gib=peak / GiB, ac_peak_baseline_gib=without / GiB,
                  ac_persistent_gib=persistent / GiB, **more)
    log_policy(name, policy.saved_bytes, policy.baseline_bytes, recomputed, f" (est. {policy.recompute_s * 1e3:.1f} ms)",
               f"simulated peak {peak / GiB:.3f} GiB ({without / GiB:.3f} without recomputation or offload, {persistent / GiB:.3f} "
               "of it parameters, optimizer state and inputs)"
               + ("" if scheduled is None else f", {scheduled / GiB:.3f} GiB with the collective schedule")
               + ("" if budget is None else f", budget {budget / GiB:.3f} GiB"),
               f"{policy.offloaded_bytes / GiB:.3f} GiB ({len(policy.offload)} activations, {policy.unhidden} of them with "
               "transfers compute does not hide)")
    reached = max(peak, scheduled or 0)
    if budget is not None and reached > budget:
        logger.warning(f"memory policy memory_budget: the budget of {budget / GiB:.3f} GiB cannot be met: recomputing all "
                       f"that lowers the simulated peak leaves {reached / GiB:.3f} GiB")


def report_partition(ctx: PassContext, saved: int) -> None:
    """aot: the `saved` bytes the min-cut partitioner chose, against the figures the joint stage reported."""
    figures = ctx.report.get("memory_policy", {})
    baseline = int(figures.get("ac_baseline_gib", 0) * GiB)
    budget = figures.get("ac_budget_gib")
    activations = figures.get("ac_activation_budget_gib")
    report_policy(ctx, saved, max(0, baseline - saved), None if budget is None else budget * GiB)
    tail = "" if activations is None else f"activation budget {activations:.3f} GiB" + (
        " (over it: nothing more can be recomputed)" if saved > activations * GiB else "")
    log_policy("memory_budget", saved, baseline, max(0, baseline - saved),
               f" (min-cut partitioner at budget share {figures.get('ac_partitioner_budget', 1.0):.2f})", tail)
