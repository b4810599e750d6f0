"""Trace a model for the solver: one forward graph per distinct unit, plus how the units connect.

A unit is a direct child of the root that owns parameters, or one element of a ModuleList /
ModuleDict child (a transformer block). The root's forward runs once on fake tensors with every
unit replaced by a recorder; the first unit of each kind (same class, parameter shapes and input
metadata) is traced with `make_fx` into an aten-level forward graph, the others reuse it. So an
80-layer model costs one block trace, and the program ties the blocks by construction.

Only the forward is traced: the backward that autograd derives through DTensor when the plan runs
is the transpose of the forward, and the cost model prices it from each forward choice (see
costs.py). That keeps the solver's graph and the graph the plan is applied to the same object.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask

from ..config import ConfigError
from ..models import drop_cudnn_attention, sdpa_wrappers, traceable_attention
from .compat import current_trace_graph
from .flex import is_batched, mask_tensors
from .memory import Kept, autograd_keeps


Position = int | str | tuple[int | str, int]
BATCH_LAID = ("input", "activations")
"""Source kinds laid out like the token batch (Shard(0) over the data-parallel dims)."""
DIFFERENTIABLE = ("unit", "activations")
"""Source kinds a gradient flows back to."""


def call_tensors(args: tuple, kwargs: dict) -> list[tuple[Position, torch.Tensor]]:
    """The tensors of a unit call and where each sits: a positional index, a keyword name, or (either,
    i) for the i-th tensor of a BlockMask argument (flex.mask_tensors)."""
    found: list[tuple[Position, torch.Tensor]] = []
    for key, a in [*enumerate(args), *kwargs.items()]:
        if isinstance(a, torch.Tensor):
            found.append((key, a))
        elif isinstance(a, BlockMask):
            found += [((key, i), t) for i, t in enumerate(mask_tensors(a))]
    return found


def tensor_at(args: tuple, kwargs: dict, pos: Position) -> torch.Tensor:
    key, i = pos if isinstance(pos, tuple) else (pos, None)
    a = args[key] if isinstance(key, int) else kwargs[key]
    return a if i is None else mask_tensors(a)[i]


@dataclass(frozen=True)
class Source:
    """Where a unit's tensor input comes from: the model input, a root buffer, or a unit's output."""

    kind: str  # "input" | "activations" | "mask" | "buffer" | "unit"
    """`input`: laid out like the token batch (the tokens, a BlockMask's per-sequence tensors); `activations`: a
    pipeline stage's input, the previous stage's output, laid out like the token batch and differentiable; `mask`:
    a BlockMask tensor shared by all sequences (flex.py); `buffer`: a root buffer; `unit`: a unit's output."""
    call: int = -1
    index: int = 0
    name: str = ""


@dataclass
class UnitGraph:
    kind: int
    modules: list[str]
    gm: fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]
    n_inputs: int
    input_positions: list[Position]
    """Where each traced input sits in the call (see `call_tensors`)."""
    node_module: dict[str, str] = field(default_factory=dict)
    """Node name -> FQN of the innermost module that produced it (for messages)."""
    kept: Kept = field(default_factory=dict)
    """What autograd keeps of the forward for backward (memory.autograd_keeps)."""


@dataclass
class UnitCall:
    module: str
    kind: int
    sources: list[Source]


@dataclass
class ModelTrace:
    units: list[UnitGraph]
    calls: list[UnitCall]
    output: Source

    def unit_of(self, module: str) -> UnitGraph:
        for u in self.units:
            if module in u.modules:
                return u
        raise KeyError(module)


def unit_modules(model: nn.Module) -> dict[str, nn.Module]:
    units: dict[str, nn.Module] = {}
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            for k, sub in child.named_children():
                units[f"{name}.{k}"] = sub
        elif any(True for _ in child.parameters()):
            units[name] = child
    own = [n for n, _ in model.named_parameters(recurse=False)]
    if own:
        raise ConfigError(f"autoparallel: the root module owns parameters {own}; move them into a submodule")
    return units


def _meta_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype)
    if isinstance(x, (int, float, str, bool, type(None))):
        return x
    if isinstance(x, BlockMask):
        return ("BlockMask", x.seq_lengths, x.BLOCK_SIZE, tuple(_meta_key(t) for t in mask_tensors(x)))
    raise ConfigError(f"autoparallel: a unit received an argument of type {type(x).__name__}, which the tracer cannot key on")


class _ModuleTimeline:
    """Attribute traced nodes to modules: hooks note the graph length whenever a module starts/ends."""

    def __init__(self, root: nn.Module, prefix: str):
        self.events: list[tuple[int, str]] = []
        self.stack: list[str] = []
        self.handles = []
        for name, m in root.named_modules():
            fqn = f"{prefix}.{name}" if name else prefix
            self.handles.append(m.register_forward_pre_hook(lambda mod, a, fqn=fqn: self._enter(fqn)))
            self.handles.append(m.register_forward_hook(lambda mod, a, o: self._exit()))

    def _mark(self) -> None:
        graph = current_trace_graph()
        if graph is not None:
            self.events.append((len(graph.nodes), self.stack[-1] if self.stack else ""))

    def _enter(self, fqn: str) -> None:
        self.stack.append(fqn)
        self._mark()

    def _exit(self) -> None:
        self.stack.pop()
        self._mark()

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def assign(self, gm: fx.GraphModule) -> dict[str, str]:
        out: dict[str, str] = {}
        j, current = 0, ""
        for i, node in enumerate(gm.graph.nodes):
            while j < len(self.events) and self.events[j][0] <= i:
                current = self.events[j][1]
                j += 1
            out[node.name] = current
        return out


def _rms_norm(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None, eps: float | None = None) -> tuple:
    """The ops of ATen's composite rms_norm (what CPUs run), so that a plan traced on a CPU matches the
    graph traced where CUDA would pick the fused kernel: the interpreter runs these ops there too."""
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    rstd = xf.pow(2).mean(dims, keepdim=True).add_(eps).rsqrt()
    out = xf * rstd
    if weight is not None:
        out = out * weight
    return out.to(x.dtype), rstd


_DECOMPOSITIONS = {op.default: _rms_norm for op in [getattr(torch.ops.aten, "_fused_rms_norm", None)] if op is not None}


_TRACED_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextmanager
def _without_cudnn_attention(module: nn.Module) -> Iterator[None]:
    restore = drop_cudnn_attention(module)
    try:
        yield
    finally:
        restore()


def _trace_unit(fqn: str, module: nn.Module, args: tuple, kwargs: dict, param_dtype: torch.dtype, mode: FakeTensorMode, kind: int,
                device: torch.device, differentiable: list[bool]) -> UnitGraph:
    """`differentiable`: per tensor of the call (`call_tensors`), whether it is another unit's output."""
    param_names = [n for n, _ in module.named_parameters()]
    buffer_names = [n for n, _ in module.named_buffers()]
    with mode:
        fake_params = [torch.empty(p.shape, dtype=param_dtype if p.is_floating_point() else p.dtype, device=device) for _, p in module.named_parameters()]
        fake_buffers = [torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=device) for _, b in module.named_buffers()]
    found = call_tensors(args, kwargs)
    positions, tensors = [p for p, _ in found], [t for _, t in found]
    n_p, n_b = len(param_names), len(buffer_names)

    def fn(*flat: torch.Tensor) -> Any:
        state = dict(zip(param_names, flat[:n_p])) | dict(zip(buffer_names, flat[n_p : n_p + n_b]))
        a, kw = list(args), dict(kwargs)
        for pos, t in zip(positions, flat[n_p + n_b :]):
            # A BlockMask's tensors (its mask function's too) stay in place: they are the very
            # objects given to make_fx, which traces every use of them as a use of these inputs.
            if isinstance(pos, int):
                a[pos] = t
            elif isinstance(pos, str):
                kw[pos] = t
        return functional_call(module, state, tuple(a), kw)

    timeline = _ModuleTimeline(module, fqn)
    try:
        # DTensor's cuDNN-attention backward strategy is broken on torch 2.11: record another kernel
        with mode, sdpa_kernel(_TRACED_SDPA), _without_cudnn_attention(module), traceable_attention():
            gm = make_fx(fn, decomposition_table=_DECOMPOSITIONS, tracing_mode="real")(*fake_params, *fake_buffers, *tensors)
    except Exception as e:  # noqa: BLE001  (any failure becomes one line naming the module)
        where = timeline.stack[-1] if timeline.stack else fqn
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"autoparallel cannot handle module {where!r}: tracing its forward failed at {type(e).__name__}: {first}; "
            "use the manual plan (drop --compile.autoparallel)"
        ) from None
    finally:
        timeline.close()
    node_module = timeline.assign(gm)
    wrappers = sdpa_wrappers(module)
    attention = {f"{fqn}.{n}" for n, m in module.named_modules() if any(m is w for w in wrappers)}
    kept = autograd_keeps(gm, n_p, n_b, differentiable, node_module, attention)
    return UnitGraph(kind, [fqn], gm, param_names, buffer_names, len(tensors), positions, node_module, kept)


def trace_model(model: nn.Module, inputs_shape: tuple[int, ...], param_dtype: torch.dtype, device: torch.device,
                activations: int = 0) -> ModelTrace:
    """`model` lives on the meta device; `inputs_shape` is the GLOBAL token batch (batch, seq). `activations`: the
    width of a pipeline stage's input (batch, seq, activations) in `param_dtype`, in place of token ids."""
    units = unit_modules(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    graphs: list[UnitGraph] = []
    keys: dict[Any, int] = {}
    calls: list[UnitCall] = []
    sources: dict[int, Source] = {}
    outputs_of: dict[int, list[torch.Tensor]] = {}
    buffers = {id(b): n for n, b in model.named_buffers() if not any(n.startswith(u + ".") for u in units)}

    with mode:
        if activations:
            tokens = torch.zeros((*inputs_shape, activations), dtype=param_dtype, device=device)
        else:
            tokens = torch.zeros(inputs_shape, dtype=torch.long, device=device)
    sources[id(tokens)] = Source("activations" if activations else "input", index=0)

    def mask_source(t: torch.Tensor, pos: tuple) -> Source:
        name = f"{pos[0]}.{pos[1]}"
        return Source("input", name=name) if is_batched(t, inputs_shape[0]) else Source("mask", name=name)

    def source_of(t: torch.Tensor, where: str) -> Source:
        if id(t) in sources:
            return sources[id(t)]
        if id(t) in buffers:
            return Source("buffer", name=buffers[id(t)])
        raise ConfigError(
            f"autoparallel: module {where!r} receives a tensor computed in the root's forward outside any unit; "
            "only unit-to-unit dataflow is supported"
        )

    def fake_buffer(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    def recorder(fqn: str, module: nn.Module):
        def forward(*args: Any, **kwargs: Any) -> Any:
            srcs = [mask_source(t, pos) if isinstance(pos, tuple) else source_of(t, fqn) for pos, t in call_tensors(args, kwargs)]
            args = tuple(fake_buffer(a) if isinstance(a, torch.Tensor) and a.device.type == "meta" else a for a in args)
            kwargs = {k: fake_buffer(v) if isinstance(v, torch.Tensor) and v.device.type == "meta" else v for k, v in kwargs.items()}
            key = (type(module).__qualname__,
                   tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()),
                   tuple(_meta_key(a) for a in args), tuple((k, _meta_key(v)) for k, v in sorted(kwargs.items())))
            if key not in keys:
                keys[key] = len(graphs)
                recording = module.__dict__.pop("forward")
                try:
                    graphs.append(_trace_unit(fqn, module, args, kwargs, param_dtype, mode, len(graphs), device,
                                              [s.kind in DIFFERENTIABLE for s in srcs]))
                finally:
                    module.forward = recording
            else:
                graphs[keys[key]].modules.append(fqn)
            unit = graphs[keys[key]]
            out_node = next(n for n in unit.gm.graph.nodes if n.op == "output")
            metas = [a.meta["val"] for a in torch.utils._pytree.tree_leaves(out_node.args[0])]
            with mode:
                outs = [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device) for m in metas]
            call = len(calls)
            calls.append(UnitCall(fqn, unit.kind, srcs))
            for i, o in enumerate(outs):
                sources[id(o)] = Source("unit", call=call, index=i)
                outputs_of.setdefault(call, []).append(o)
            if len(outs) != 1:
                raise ConfigError(f"autoparallel: unit {fqn!r} returns {len(outs)} tensors; units must return one tensor")
            return outs[0]

        return forward

    saved = {}
    for fqn, m in units.items():
        saved[fqn] = m.__dict__.get("forward")
        m.forward = recorder(fqn, m)
    try:
        out = model(tokens)
    finally:
        for fqn, m in units.items():
            if saved[fqn] is None:
                del m.forward
            else:
                m.forward = saved[fqn]
    if not isinstance(out, torch.Tensor) or id(out) not in sources or sources[id(out)].kind != "unit":
        raise ConfigError("autoparallel: the model's output must be the output of its last unit")
    return ModelTrace(graphs, calls, sources[id(out)])
