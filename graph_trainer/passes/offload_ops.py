"""Our four ops that move an activation to host memory and back, in the "start + wait" pattern of
c10d's functional collectives, so the train-step graph shows each transfer and where compute waits:

    host = offload(x)              D2H copy of x into pinned host memory, on a side stream
    wait_offload(host, x)          compute waits for that copy; x is read here last, so its device
                                   storage is freed after this node, and the allocator may reuse it
                                   on the compute stream only once the copy has read it
    y = reload(host, device)       H2D copy into a fresh device tensor, on another side stream
    wait_reload(y, host)           compute waits for that copy before the first backward use of y

The waits are declared as writing their first argument (the transfer completes it): that makes them
impure, so no dead-code elimination drops them, and every pass that keeps mutations in order keeps
them where the graph put them. Each wait also reads the copy's source, so the source stays alive
until the copy is known to be done (no `record_stream` needed, and the liveness simulation sees
exactly what the allocator sees). The event of a pending copy is kept by the data pointer of the
tensor the copy writes. The reload's stream waits for the offload's event itself, so the H2D copy
never reads host memory the D2H copy has not filled, even if a backend moved the reload before the
offload's wait.

On a CPU device the ops copy into a separate CPU tensor and the waits do nothing; under fake tensors
(make_fx, fake process groups) their fake implementations give tensors of the right shape, strides,
dtype and device. Copies keep the strides of their source, so kernels reading the reloaded value see
the layout they saw in forward and give the same bits.
"""

from __future__ import annotations

import torch

_pending: dict[int, "torch.cuda.Event"] = {}
_streams: dict[tuple[torch.device, str], "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device, direction: str) -> "torch.cuda.Stream":
    """One stream per device and direction: D2H and H2D use the two directions of the link at once."""
    key = (device, direction)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device)
    return _streams[key]


def _empty_like(t: torch.Tensor, device: torch.device, pin: bool = False) -> torch.Tensor:
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device, pin_memory=pin)


def _copy_on_side_stream(dst: torch.Tensor, src: torch.Tensor, device: torch.device, direction: str) -> None:
    stream = _side_stream(device, direction)
    # The side stream starts where compute is now: the source is written and the destination's
    # memory (a block the compute stream may have used before) is free.
    stream.wait_stream(torch.cuda.current_stream(device))
    filled = _pending.pop(src.data_ptr(), None)
    if filled is not None:
        stream.wait_event(filled)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    _pending[dst.data_ptr()] = event


def _wait(t: torch.Tensor, device: torch.device, done: bool) -> None:
    """Compute waits for the copy into `t`; `done`: nothing else will wait for it."""
    event = _pending.pop(t.data_ptr(), None) if done else _pending.get(t.data_ptr())
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


@torch.library.custom_op("graph_trainer::offload", mutates_args=())
def offload(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cuda":
        return _empty_like(x, torch.device("cpu")).copy_(x)
    host = _empty_like(x, torch.device("cpu"), pin=True)
    _copy_on_side_stream(host, x, x.device, "d2h")
    return host


@offload.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return _empty_like(x, torch.device("cpu"))


@torch.library.custom_op("graph_trainer::wait_offload", mutates_args=("host",))
def wait_offload(host: torch.Tensor, source: torch.Tensor) -> None:
    if source.device.type == "cuda":
        _wait(host, source.device, done=False)


@wait_offload.register_fake
def _(host: torch.Tensor, source: torch.Tensor) -> None:
    return None


@torch.library.custom_op("graph_trainer::reload", mutates_args=())
def reload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return _empty_like(host, device).copy_(host)
    out = _empty_like(host, device)
    _copy_on_side_stream(out, host, device, "h2d")
    return out


@reload.register_fake
def _(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return _empty_like(host, device)


@torch.library.custom_op("graph_trainer::wait_reload", mutates_args=("out",))
def wait_reload(out: torch.Tensor, host: torch.Tensor) -> None:
    if out.device.type == "cuda":
        _wait(out, out.device, done=True)


@wait_reload.register_fake
def _(out: torch.Tensor, host: torch.Tensor) -> None:
    return None


OFFLOAD = torch.ops.graph_trainer.offload.default
WAIT_OFFLOAD = torch.ops.graph_trainer.wait_offload.default
RELOAD = torch.ops.graph_trainer.reload.default
WAIT_RELOAD = torch.ops.graph_trainer.wait_reload.default
