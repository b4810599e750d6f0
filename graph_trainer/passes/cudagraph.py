"""cudagraph: replay the whole train step as one CUDA graph (no per-kernel launch cost).

The first `num_params + num_buffers` inputs are captured in place: the optimizer updates parameters
in place and buffers never change, so their addresses hold from step to step (checked on every call).
The batch is copied into static buffers before each replay. Every captured step of the process
(a retrace captures another) allocates from one memory pool, warm-up included, on one stream, so
their memory is shared. `run_teardowns()` destroys the graphs before the process group goes.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import torch
from torch import fx

from .compat import use_cuda_memory_pool
from .registry import Compiled, PassContext, PassSpec, register_pass, register_teardown


class _Pool:
    """The shared memory pool and capture stream; an empty graph captured into the pool keeps it alive
    between captures."""

    def __init__(self, device: torch.device):
        self.device = device
        self.handle = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.anchor = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the CUDA graph is empty": intended
            with torch.cuda.graph(self.anchor, pool=self.handle, stream=self.stream):
                pass
        self.steps: weakref.WeakSet[CUDAGraphStep] = weakref.WeakSet()


_POOL: _Pool | None = None


def _shared_pool(device: torch.device) -> _Pool:
    global _POOL
    if _POOL is None:
        _POOL = _Pool(device)
        register_teardown(release_graphs)
    return _POOL


def release_graphs() -> None:
    """Destroy every captured graph and the pool: graphs that hold NCCL work must go before the
    communicators do, or the process can hang at exit."""
    global _POOL
    if _POOL is None:
        return
    torch.cuda.synchronize(_POOL.device)
    for step in list(_POOL.steps):
        step.reset()
    _POOL.anchor.reset()
    _POOL = None


class CUDAGraphStep:
    """Call 1 runs eagerly (warm-up); call 2 captures, then every call replays."""

    def __init__(self, runnable: Callable[..., Any], num_static: int, pool: _Pool):
        self.runnable = runnable
        self.num_static = num_static
        self.pool = pool
        self.warmed_up = False
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: list[torch.Tensor] = []
        self.static_outputs: tuple[torch.Tensor, ...] = ()
        self.addresses: list[int] = []
        pool.steps.add(self)

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.warmed_up:
            # Lazy initialisation (NCCL communicators, cuBLAS handles, Inductor autotuning) must not
            # happen under capture. Allocating in the pool on the capture stream now lets the capture
            # reuse this memory instead of holding a second copy of it.
            index = self.pool.device.index if self.pool.device.index is not None else torch.cuda.current_device()
            with use_cuda_memory_pool(index, self.pool.handle, self.pool.stream):
                out = self.runnable(*args)
            self.warmed_up = True
            return tuple(out)
        if self.graph is None:
            self._capture(args)
        elif [a.data_ptr() for a in args[: self.num_static]] != self.addresses:
            raise RuntimeError(
                "cudagraph: a parameter or buffer was replaced since the train step was captured (it must be "
                "updated in place); remove cudagraph from --compile.passes"
            )
        for static, new in zip(self.static_inputs[self.num_static :], args[self.num_static :]):
            static.copy_(new)
        self.graph.replay()
        # The outputs live in the pool and the next replay overwrites them, but the caller keeps them
        # (the first microbatch's gradient shards become `param.grad`): hand out copies.
        return tuple(o.clone() for o in self.static_outputs)

    def _capture(self, args: tuple[torch.Tensor, ...]) -> None:
        n = self.num_static
        self.static_inputs = [*args[:n], *(a.clone() for a in args[n:])]
        self.addresses = [a.data_ptr() for a in args[:n]]
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool.handle, stream=self.pool.stream, capture_error_mode="thread_local"):
            self.static_outputs = tuple(self.runnable(*self.static_inputs))

    def reset(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        self.static_outputs = ()


def cudagraph(step: Any, ctx: PassContext) -> Compiled:
    graph_module = step if isinstance(step, fx.GraphModule) else getattr(step, "graph_module", None)
    runner = CUDAGraphStep(step, ctx.num_params + ctx.num_buffers, _shared_pool(ctx.device))
    return Compiled(runner, graph_module)


register_pass(PassSpec(
    name="cudagraph",
    description="capture the final train step into a CUDA graph and replay it (params/buffers static, batch copied in)",
    stages=("train_step",),
    modes=("aot_fx_trace",),
    fn=cudagraph,
    must_be_last=True,
    cuda_only=True,
    compiles=True,
    wraps_compiled=True,
    # NCCL registers the user buffers of collectives captured into a CUDA graph (NCCL_GRAPH_REGISTER,
    # on by default); with buffers from the graph pool that registration can fail or hang the capture
    # of collectives, so it is off unless the user chose. It must be set before NCCL initialises.
    env_defaults=(("NCCL_GRAPH_REGISTER", "0"),),
))
