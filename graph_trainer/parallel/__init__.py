"""Manual placement: TP and EP plans, then SimpleFSDP over the data-parallel dimensions, then
activation checkpointing, in that order (each wraps what the previous one produced)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from ..blocks import CHECKPOINTED_KEY
from ..config import JobConfig
from ..models import ModelSpec
from ..regions import annotate_module
from .mesh import Meshes
from .simple_fsdp import MixedPrecision, apply_simple_fsdp
from .tensor_parallel import apply_tensor_parallel
from .vocab_embedding import read_in_place


def parallelize(model: nn.Module, spec: ModelSpec, meshes: Meshes, mp: MixedPrecision, moe_capacity_factor: float = 0.0,
                moe_chunks: int = 1, embedding_by_vocab: bool = False) -> nn.Module:
    """Place a meta-device model on the mesh by hand (the SimpleFSDP plan); `embedding_by_vocab`: the token embedding
    read in place (vocab_embedding.py)."""
    if meshes.degrees.tp > 1:
        apply_tensor_parallel(model, spec.name, meshes.tp)
    if spec.is_moe:
        from .expert_parallel import prepare_moe

        prepare_moe(model, meshes, moe_capacity_factor, moe_chunks)
    model = apply_simple_fsdp(model, meshes, mp)
    if embedding_by_vocab:
        read_in_place(model, mp)
    return model


OP_SAC_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops.aten.max.default,
}
"""Ops whose outputs op-level selective AC saves (of matmuls, every other one): torchtitan's list."""


def policy_name(cfg: JobConfig) -> str | None:
    """Which policy the `memory_policy` pass applies on the traced step in place of torchtitan's
    wrappers, or None: `memory_budget`, and op-level selective AC in a whole-step aot_fx_trace, where
    make_fx would only tag the ops (no partitioner reads tags in one train-step graph). Op-level
    selective AC in aot and in pipeline stages is torch's own: the partitioner reads the tags the
    wrappers set (`passes/checkpoint_tags.py`)."""
    ac = cfg.activation_checkpoint
    if ac.mode == "memory_budget":
        return "memory_budget"
    if ac.mode == "selective" and ac.selective_ac_option == "op" and cfg.compile.mode == "aot_fx_trace" and cfg.parallelism.pp == 1:
        return "op"
    return None


def apply_activation_checkpointing(model: nn.Module, cfg: JobConfig) -> None:
    """torchtitan's checkpoint wrappers, except where the `memory_policy` pass decides on the traced
    step instead (`policy_name`); the pass reads the block marks (`blocks.annotate_blocks`, which
    whoever traces the model applies) and keeps its recomputations within a block."""
    ac = cfg.activation_checkpoint
    mode, option = ac.mode, ac.selective_ac_option
    if mode == "none" or policy_name(cfg):
        return
    from torchtitan.config import ActivationCheckpoint as TitanAC
    from torchtitan.distributed.activation_checkpoint import apply_ac

    apply_ac(model, TitanAC(mode=mode, selective_ac_option=option), op_sac_save_list=OP_SAC_SAVE_LIST)
    # op-level selective AC wraps every block too, but saves or recomputes op by op (its own tags)
    if mode == "full" or option != "op":
        for block in model.layers.values():
            if isinstance(block, CheckpointWrapper):
                annotate_module(block, {CHECKPOINTED_KEY: True})
