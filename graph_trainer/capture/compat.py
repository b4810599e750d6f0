"""The private torch APIs the jit and aot capture modes use, imported in one place.

They exist in torch 2.11 through 2.13 (checked on both); a torch without them fails here with one
message naming what is missing, instead of deep inside a capture. Every call into them passes
keyword arguments past the first positional ones, because their keyword sets are what stayed stable.
"""

from __future__ import annotations

import torch

try:
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch._aot_autograd.descriptors import BufferAOTInput, ParamAOTInput
    from torch._functorch._aot_autograd.utils import make_boxed_func
    from torch._functorch.aot_autograd import (
        aot_compile_joint_with_descriptors,
        aot_export_joint_with_descriptors,
    )
    from torch._functorch.partitioners import min_cut_rematerialization_partition
except ImportError as e:  # pragma: no cover  (only on a torch outside the supported range)
    raise ImportError(
        f"graph-trainer's jit/aot modes need torch 2.11-2.13 private AOTAutograd APIs; torch {torch.__version__} "
        f"lacks one ({e}); use --compile.mode eager or aot_fx_trace"
    ) from e

__all__ = [
    "BufferAOTInput",
    "ParamAOTInput",
    "aot_autograd",
    "aot_compile_joint_with_descriptors",
    "aot_export_joint_with_descriptors",
    "make_boxed_func",
    "min_cut_rematerialization_partition",
]
