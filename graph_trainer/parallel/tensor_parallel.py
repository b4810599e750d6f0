"""Tensor parallelism: torchtitan's Megatron-style plans (column/row-parallel linears,
sequence-parallel norms), applied on the `tp` mesh before SimpleFSDP wraps the parameters."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def apply_tensor_parallel(model: nn.Module, model_name: str, tp_mesh: DeviceMesh) -> None:
    if model_name == "llama3":
        from torchtitan.models.llama3.infra.parallelize import apply_tp

        apply_tp(model, tp_mesh, loss_parallel=False, enable_float8_tensorwise_tp=False)
        return
    from .expert_parallel import apply_moe_model_tp

    apply_moe_model_tp(model, tp_mesh)
