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
    if model_name == "qwen3":
        _apply_qwen3_tp(model, tp_mesh)
        return
    from .expert_parallel import apply_moe_model_tp

    apply_moe_model_tp(model, tp_mesh)


def _apply_qwen3_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """torchtitan's Qwen3 plan (Llama's Megatron plan plus sequence-parallel q/k norms) for attention and
    dense MLPs. Qwen3's MoE blocks have no shared experts; their router gate is replicated on `tp` as
    DeepSeek's is, so that its gradient sums the tp ranks' partial contributions. The plan keeps q, k
    and v as DTensors into SDPA (for the sequence-parallel q/k norms), which on CPU needs the
    strategies DTensor lacks for the CPU flash kernel."""
    from torchtitan.models.qwen3.infra.parallelize import apply_non_moe_tp

    from ..autoparallel.compat import register_cpu_attention_strategies
    from .expert_parallel import replicate_router_gates

    register_cpu_attention_strategies()
    apply_non_moe_tp(model, tp_mesh, loss_parallel=False, enable_float8_tensorwise_tp=False, enable_async_tp=False, cp_enabled=False)
    replicate_router_gates(model, tp_mesh)
