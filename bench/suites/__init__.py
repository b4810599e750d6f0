"""Every suite by name: a function (steps, gpus) -> the runs, in order."""

from __future__ import annotations

from .multi import MULTI_CONFIGS, suite_h200x2, suite_multi, suite_numerics
from .one_gpu import suite_flex, suite_h100
from .scale import suite_scale

SUITES = {"h100": suite_h100, "h200x2": suite_h200x2, "scale": suite_scale, "flex": suite_flex, "multi": suite_multi,
          "numerics": suite_numerics}
GPU_COUNTS = {"multi": tuple(MULTI_CONFIGS)}
"""Suites whose runs depend on the machine's GPU count, and the counts they have configs for."""
