"""The private torch APIs the Inductor and CUDA-graph passes use, imported in one place.

Checked on torch 2.11 (GPU machine) and 2.13 (CPU): `standalone_compile(gm, example_inputs, *,
dynamic_shapes, options, aot)` has those keywords in both (2.13 adds more, unused here);
`regional_inductor(gm, *example_args)` compiles each region with `standalone_compile(...,
dynamic_shapes="from_tracing_context", aot=True)` in both; `_use_cuda_memory_pool_manager(device,
pool, stream)` is the same context manager in both. For the compile cache: `CompiledArtifact.save(*, path,
format)` / `CompiledArtifact.load(*, path, format)`, `torch._inductor.config.get_hash()` and
`cpu_vec_isa.pick_vec_isa()` are the same in both. `_LazyGraphModule` (a GraphModule that writes its
Python code when first called) and `_use_lazy_graph_module(on)` (make_fx then returns one) are in both, as is
`torch.fx._graph_pickler` (`GraphPickler.dumps/loads`, `Options(ops_filter=...)`).
"""

from __future__ import annotations

import copy
import importlib.metadata
from typing import Callable

import torch
from torch import fx

try:
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor import CompiledArtifact, standalone_compile
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx import _graph_pickler as graph_pickler
    from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
    from torch.fx._lazy_graph_module import _use_lazy_graph_module as lazy_graph_modules
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.regional_inductor import regional_inductor
except ImportError as e:  # pragma: no cover  (only on a torch outside the supported range)
    raise ImportError(
        f"graph-trainer's Inductor passes need torch 2.11-2.13 private APIs; torch {torch.__version__} lacks one ({e}); "
        "use --compile.inductor_compilation none"
    ) from e


def copy_node_as(graph: fx.Graph, node: fx.Node, transform: Callable[[fx.Node], fx.Node], name: str) -> fx.Node:
    """`graph.node_copy(node, transform)` under `name`, a name not yet taken. A copy takes its node's name, taken
    already where it is copied into the node's own graph (or a piece's names into the graph stitched from pieces);
    torch 2.11 (fixed in 2.13) then resolves it by counting up from its suffix through every name made before:
    stitching llama3 70B's 505 pieces spent 34 s of 39 s naming nodes, and `reshard_after_forward` 4.3 of its 6.8 s
    (its 2,720 copies, cProfile; one H200, bench/results/2026-12-02-session35)."""
    copied = graph.create_node(node.op, node.target, fx.node.map_arg(node.args, transform),
                               fx.node.map_arg(node.kwargs, transform), name, node.type)
    copied.meta = copy.copy(node.meta)
    return copied


def use_cuda_memory_pool(device: int, pool: tuple[int, int], stream: torch.cuda.Stream):
    """Allocations of the current thread go to `pool`, on `stream` (for the CUDA-graph warm-up)."""
    from torch._inductor.cudagraph_trees import _use_cuda_memory_pool_manager

    return _use_cuda_memory_pool_manager(device, pool, stream)


def enable_symmetric_memory(group_name: str) -> None:
    """Let the symm_mem ops (async TP) allocate symmetric memory over the group's ranks."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(group_name)


def symm_mem_ops():
    """`torch.ops.symm_mem`, with the fused async-TP ops in it: torch defines them when
    torch.distributed._symmetric_memory is imported, which nothing else here may have done (torch 2.11
    and 2.13: without it, `fused_matmul_reduce_scatter` is no attribute of the namespace)."""
    import torch.distributed._symmetric_memory  # noqa: F401

    return torch.ops.symm_mem


def cpu_vector_isa() -> str:
    """The vector instruction set Inductor writes C++ kernels for on this CPU (e.g. "avx512")."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa())


def triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "none"


__all__ = [
    "CompiledArtifact",
    "FakeTensor",
    "FakeTensorMode",
    "LazyGraphModule",
    "graph_pickler",
    "lazy_graph_modules",
    "ShapeEnv",
    "TracingContext",
    "detect_fake_mode",
    "regional_inductor",
    "cpu_vector_isa",
    "enable_symmetric_memory",
    "select_decomp_table",
    "standalone_compile",
    "symm_mem_ops",
    "tracing",
    "triton_version",
    "use_cuda_memory_pool",
]
