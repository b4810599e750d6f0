"""The private torch APIs the jit and aot capture modes (and the trace cache) use, imported in one place.

They exist in torch 2.11 through 2.13 (checked on both); a torch without them fails here with one
message naming what is missing, instead of deep inside a capture. Every call into them passes
keyword arguments past the first positional ones, because their keyword sets are what stayed stable.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import fx

try:
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch._aot_autograd.descriptors import BufferAOTInput, ParamAOTInput
    from torch._functorch._aot_autograd.utils import make_boxed_func
    from torch._functorch.aot_autograd import (
        aot_compile_joint_with_descriptors,
        aot_export_joint_with_descriptors,
    )
    from torch._functorch import config as functorch_config
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
    "min_cut_partition",
    "untraced_sharding_propagation",
]


def _is_opaque(node: Any) -> bool:
    return isinstance(node, fx.Node) and not isinstance(node.meta.get("val"), (torch.Tensor, torch.SymInt))


def min_cut_partition(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """`min_cut_rematerialization_partition`, with the saved values put back in the order the
    AOTAutograd runtime reads them: tensors, then opaque objects, then symints.

    torch 2.13 flattens a DTensor into its local tensor and its device mesh (an opaque object), and
    when activation checkpointing recomputes a seeded op (CPU SDPA) its RNG-state tensors are
    appended after the saved opaque objects; the runtime then takes a mesh for a tensor ("expected
    all tensors_saved_with_vc_check to be Tensors"). Such tensors are moved in front of the opaque
    objects, in the forward outputs and in the backward inputs alike; otherwise nothing changes.
    """
    # Under an activation memory budget the partitioner sizes every saved value; the opaque device
    # meshes hold no tensors (torch 2.13 refuses to size them unless told they are empty).
    options = {"unsafe_treat_script_objects_as_zero_size": True} if hasattr(functorch_config, "unsafe_treat_script_objects_as_zero_size") else {}
    with functorch_config.patch(**options):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    output = fw.graph.find_nodes(op="output")[0]
    saved = list(output.args[0][num_fwd_outputs:])
    first = next((i for i, n in enumerate(saved) if _is_opaque(n)), None)
    late = [] if first is None else [i for i in range(first, len(saved)) if isinstance(saved[i].meta.get("val"), torch.Tensor)]
    if not late:
        return fw, bw
    order = list(range(first)) + late + [i for i in range(first, len(saved)) if i not in late]
    output.args = (tuple(output.args[0][:num_fwd_outputs]) + tuple(saved[i] for i in order),)
    # The backward takes the saved symints first, then the saved values in the forward's order.
    inputs = list(bw.graph.find_nodes(op="placeholder"))
    num_symints = sum(1 for n in saved if isinstance(n.meta.get("val"), torch.SymInt))
    anchor = inputs[num_symints + first]
    for i in late:
        anchor.prepend(inputs[num_symints + i])
    fw.recompile()
    bw.recompile()
    return fw, bw


@contextlib.contextmanager
def untraced_sharding_propagation() -> Iterator[None]:
    """While make_fx traces, keep DTensor's output-shape propagation out of the graph.

    DTensor derives an op's global output shape by running the op on fake global-shape tensors made
    on the default device. torch 2.13 does that with make_fx's proxy tracing disabled; torch 2.11
    does not, so the traced graph gets a dead copy of every DTensor op on CPU tensors. Run as FX,
    the copies cost CPU time each step, and under deterministic algorithms their uninitialized index
    tensors are filled with out-of-range values, so the copied embedding fails.
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    original = ShardingPropagator.__dict__.get("_propagate_tensor_meta_non_cached")
    if original is None:  # another torch: nothing known to guard
        yield
        return

    def propagate(self: ShardingPropagator, op_schema: Any) -> Any:
        with disable_proxy_modes_tracing():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original
