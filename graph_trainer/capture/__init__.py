"""Capture modes: each turns the model + loss into a `Step` the trainer calls once per microbatch.

A mode registers itself (registry.py) by name; the trainer looks it up here and never branches on
which it has.
"""

from __future__ import annotations

from .registry import CAPTURES, CaptureContext, Step, own_grad_norm

__all__ = ["CaptureContext", "Step", "build_step", "own_grad_norm"]


def build_step(mode: str, ctx: CaptureContext) -> Step:
    # Each module registers its mode on import (aot_fx_trace: optimizer_in_graph, which knows both of
    # its step classes), imported on first use as they load torch's compilers.
    from . import aot, eager, jit, optimizer_in_graph  # noqa: F401

    return CAPTURES[mode](ctx)
