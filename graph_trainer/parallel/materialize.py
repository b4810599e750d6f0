"""Materialise a sharded meta model: allocate the local shards and fill them with the weights a
single process would have, without ever holding the whole model.

The model is initialised one unit at a time (the root's own parameters, then each transformer
block) on an unsharded meta twin, with a seed derived from the unit's index, and each rank copies
its shards out. The weights therefore depend on the seed alone, never on the mesh: that is what
lets losses on 1, 2 or 4 ranks agree.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.tensor import distribute_tensor


def _init_units(reference: nn.Module) -> list[tuple[str, nn.Module]]:
    return [("", reference)] + [(f"layers.{k}", blk) for k, blk in reference.layers.items()]


def _call_init(module: nn.Module, device: torch.device, skip_layers: bool) -> None:
    kwargs = {"buffer_device": device} if "buffer_device" in inspect.signature(module.init_weights).parameters else {}
    if not skip_layers:
        module.init_weights(**kwargs)
        return
    layers = module.layers
    module.layers = nn.ModuleDict()
    try:
        module.init_weights(**kwargs)
    finally:
        module.layers = layers


def _own_tensors(unit: nn.Module, skip_layers: bool):
    for name, p in unit.named_parameters():
        if not (skip_layers and name.startswith("layers.")):
            yield name, p, True
    for name, b in unit.named_buffers():
        if not (skip_layers and name.startswith("layers.")):
            yield name, b, False


@torch.no_grad()
def materialize(model: nn.Module, reference: nn.Module, device: torch.device, seed: int) -> None:
    """`model`: parallelised, on meta. `reference`: the same architecture, unparallelised, on meta."""
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    for index, (prefix, unit) in enumerate(_init_units(reference)):
        is_root = prefix == ""
        if is_root:
            _root_to_empty(unit, device)
        else:
            unit.to_empty(device=device)
        torch.manual_seed(seed * 100_003 + index)
        _call_init(unit, device, skip_layers=is_root)
        for name, full, is_param in _own_tensors(unit, skip_layers=is_root):
            fqn = f"{prefix}.{name}" if prefix else name
            if not _holds(model, fqn, params):
                continue
            if is_param:
                target = params[fqn]
                shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(shard.to_local())
            else:
                owner, _, short = fqn.rpartition(".")
                model.get_submodule(owner)._buffers[short] = full.clone()
        if not is_root:
            unit.to_empty(device="meta")


def _holds(model: nn.Module, fqn: str, params: dict[str, nn.Parameter]) -> bool:
    """Whether this rank's model has the tensor: a pipeline stage holds only some modules (parallel/pipeline.py)."""
    if fqn in params:
        return True
    owner, _, short = fqn.rpartition(".")
    try:
        return short in model.get_submodule(owner)._buffers
    except AttributeError:
        return False


def _root_to_empty(root: nn.Module, device: torch.device) -> None:
    """Allocate the root's own tensors only: the blocks are allocated one at a time later."""
    for module_name, module in root.named_modules():
        if module_name.startswith("layers"):
            continue
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty_like(b, device=device)
