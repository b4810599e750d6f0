"""Model specs: torchtitan 0.2.2's Llama 3 and DeepSeek V3 definitions, imported, plus our flavors.

A spec says how to build a model on the meta device for a flavor; placement and materialisation
happen later (parallel/), so a 70B model never exists unsharded in host memory.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavors: dict[str, Any]
    model_cls: type[nn.Module]
    is_moe: bool
    hf_adapter: Callable[..., Any] | None = None
    """torchtitan's state-dict adapter to and from Hugging Face names (hf_checkpoint.py)."""

    def args_for(self, flavor: str, seq_len: int, n_layers: int = 0, attention: str = "flavor", vocab_size: int = 0) -> Any:
        args = copy.deepcopy(self.flavors[flavor])
        args.max_seq_len = seq_len
        if n_layers:
            args.n_layers = n_layers
        if vocab_size:
            args.vocab_size = vocab_size
        if attention == "sdpa" and hasattr(args, "attn_type"):
            args.attn_type, args.attn_mask_type = "sdpa", "causal"
        return args

    def job_args(self, cfg: Any, tokenizer: Any = None) -> Any:
        """The model args a job config asks for (flavor, sequence length, layers, attention, vocabulary).

        A job that trains on text with `--model.tokenizer_path` gets that tokenizer's vocabulary size
        (`tokenizer` when the caller has loaded it) padded by `padded_vocab`. The shipped tokenizer's
        2048 ids fit every flavor, which keeps its own vocabulary then, as it does on random tokens (the
        benchmarks share it with torchtitan)."""
        m = cfg.model
        vocab_size = 0
        if m.tokenizer_path and not cfg.training.random_tokens:
            if tokenizer is None:
                from .data.tokenizer import build_tokenizer

                tokenizer = build_tokenizer(m.tokenizer_path)
            vocab_size = padded_vocab(tokenizer.get_vocab_size())
        return self.args_for(m.flavor, cfg.training.seq_len, m.n_layers, m.attention, vocab_size)


VOCAB_MULTIPLE = 128


def padded_vocab(tokens: int) -> int:
    """Rows of the embedding and output for a tokenizer of `tokens` ids: the next multiple of
    `VOCAB_MULTIPLE` (as Megatron pads). TP splits both over the vocabulary and uneven splits break
    its collectives; a fixed multiple that every tp the validator allows divides (tp divides the
    heads, and every flavor's head counts divide 128) keeps the stored model the same on every mesh,
    so a checkpoint or export resumes on any other. The extra rows are ids no token has."""
    return -(-tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _llama3() -> ModelSpec:
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, llama3_args
    from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

    flavors = dict(llama3_args)
    # Single-GPU benchmark size (1.43B with the 128K vocabulary): the baseline figures use it.
    flavors["1B"] = TransformerModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
        ffn_dim_multiplier=1.3, multiple_of=1024, rope_theta=500000,
    )
    flavors["1B_flex_attn"] = dataclasses.replace(flavors["1B"], attn_type="flex", attn_mask_type="block_causal")
    return ModelSpec("llama3", flavors, Transformer, is_moe=False, hf_adapter=Llama3StateDictAdapter)


def _deepseek_v3() -> ModelSpec:
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args
    from torchtitan.models.deepseek_v3.model.state_dict_adapter import DeepSeekV3StateDictAdapter

    flavors = {}
    for name, args in deepseekv3_args.items():
        args = copy.deepcopy(args)
        args.moe_impl = "standard"
        flavors[name] = args
    return ModelSpec("deepseek_v3", flavors, DeepSeekV3Model, is_moe=True, hf_adapter=DeepSeekV3StateDictAdapter)


def _qwen3() -> ModelSpec:
    """Dense flavors (debugmodel, 0.6B to 32B) and MoE ones (debugmodel_moe, 30B-A3B, 235B-A22B) in one
    family: blocks of a dense flavor have no `moe`, so the MoE placement finds nothing to do there."""
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter, qwen3_args

    flavors = {}
    for name, args in qwen3_args.items():
        # SimpleFSDP gives every parameter its own sharded storage, so a tied output projection would
        # silently become a second, uninitialised tensor: tied flavors train with separate weights,
        # both initialised as torchtitan does (HF checkpoints without lm_head load it from the embedding).
        # Qwen3 MoE routes by its softmax scores alone (Hugging Face's Qwen3MoE has no score-correction
        # bias): torchtitan's load-balancing bias would make every export pick other experts than we trained.
        moe_args = dataclasses.replace(args.moe_args, load_balance_coeff=None)
        flavors[name] = dataclasses.replace(args, enable_weight_tying=False, moe_args=moe_args)
    return ModelSpec("qwen3", flavors, Qwen3Model, is_moe=True, hf_adapter=Qwen3StateDictAdapter)


_BUILDERS: dict[str, Callable[[], ModelSpec]] = {"llama3": _llama3, "deepseek_v3": _deepseek_v3, "qwen3": _qwen3}
_CACHE: dict[str, ModelSpec] = {}


def model_names() -> list[str]:
    return list(_BUILDERS)


def get_spec(name: str) -> ModelSpec:
    if name not in _CACHE:
        _CACHE[name] = _BUILDERS[name]()
    return _CACHE[name]


def build_on_meta(spec: ModelSpec, args: Any, device_type: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build the model with meta parameters of `dtype` (`--training.dtype`; torchtitan's models compute their
    rotary tables in fp32 whatever it is); grouped GEMMs for MoE only where the GPU has them."""
    if spec.is_moe:
        args.moe_args.use_grouped_mm = device_type == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
    from torchtitan.tools.utils import set_default_dtype

    with torch.device("meta"), set_default_dtype(dtype):
        return spec.model_cls(args)


def stored_dtype(cfg: Any) -> torch.dtype:
    """The dtype `--training.dtype` stores parameters in."""
    return getattr(torch, cfg.training.dtype)


def build_to_place(spec: ModelSpec, args: Any, device_type: str, separator_id: int | None,
                   dtype: torch.dtype = torch.float32) -> nn.Module:
    """A meta-device model as placement takes it: with the attention masks it builds from its tokens, which
    the solver traces its forward with (install_attention_masks)."""
    model = build_on_meta(spec, args, device_type, dtype)
    install_attention_masks(model, separator_id)
    return model


def document_mask_mod(tokens: torch.Tensor, eos_id: int) -> Callable[..., torch.Tensor]:
    """Attention stays inside a document; a document ends with (and includes) its EOS token.

    The same mask as torchtitan's `get_document_mask_mod`, but its document index is computed as
    `cumsum(eos) - eos` instead of a shifted copy (`index[:, 1:] = cumsum[:, :-1]`): the shift
    becomes a masked load that Inductor's FlexAttention template cannot generate inside the mask
    function ("'function' object has no attribute 'graph'") when the mask is built in the same
    compiled graph as the attention.
    """
    eos = (tokens == eos_id).to(torch.int32)
    document = torch.cumsum(eos, dim=1, dtype=torch.int32) - eos

    def same_document(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return document[b, q_idx] == document[b, kv_idx]

    return same_document


def install_attention_masks(model: nn.Module, separator_id: int | None) -> None:
    """Let a FlexAttention model (`attn_type = "flex"`) build its BlockMask from the tokens it is
    called with, inside its own call.

    torchtitan leaves the mask to the caller (`get_attention_masks`, through a compiled
    `create_block_mask`). Built inside the call instead, every capture mode sees it: eager, Dynamo, and
    a traced train step, whose graph then computes the mask from each batch's tokens rather than
    baking in the mask of the batch it was traced on (`block_causal` masks depend on where the
    documents end). The mask is built uncompiled because make_fx cannot trace into torch.compile.
    Documents end at `separator_id` (the data's `document_separator`); when the tokenizer has no
    separator, documents are not marked in the stream and the mask is causal over the whole sequence.
    """
    args = model.model_args
    if getattr(args, "attn_type", "sdpa") != "flex":
        return
    from torch.nn.attention.flex_attention import and_masks, create_block_mask
    from torchtitan.models.attention import get_causal_mask_mod

    def block_mask(tokens: torch.Tensor):
        mask_mods, batch = [get_causal_mask_mod()], 1
        if args.attn_mask_type == "block_causal" and separator_id is not None:
            mask_mods.append(document_mask_mod(tokens, separator_id))
            batch = tokens.shape[0]
        seq = tokens.shape[1]
        return create_block_mask(and_masks(*mask_mods), batch, None, seq, seq, device=tokens.device)

    def add_masks(module: nn.Module, call_args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("attention_masks") is None:
            kwargs = {**kwargs, "attention_masks": block_mask(call_args[0])}
        return call_args, kwargs

    model.register_forward_pre_hook(add_masks, with_kwargs=True)


@contextlib.contextmanager
def traceable_attention() -> Iterator[None]:
    """While a step is traced, FlexAttention is called as the op itself.

    torchtitan calls it through a class-wide `torch.compile`d function, which make_fx and
    AOTAutograd's export cannot trace into. The traced graph then holds the `flex_attention`
    higher-order op, which Inductor compiles (regional_inductor: as part of the attention region).

    Uncompiled, the op's front end still runs it through a `torch.compile` with a new backend on every
    call, so every call after a process's first recompiles; once a recompile sees another model's
    scale or sizes, Dynamo's automatic dynamism makes the scale a tensor (a `_tensor_constant` in our
    graph) and the sizes symbols. Traced calls keep them the Python numbers the model passes.
    """
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.attention import FlexAttentionWrapper

    compiled = FlexAttentionWrapper._compiled_flex_attn
    FlexAttentionWrapper._compiled_flex_attn = flex_attention
    try:
        with torch._dynamo.config.patch(specialize_float=True, automatic_dynamic_shapes=False):
            yield
    finally:
        FlexAttentionWrapper._compiled_flex_attn = compiled


def sdpa_wrappers(model: nn.Module) -> list[nn.Module]:
    """torchtitan's SDPA modules: each calls `F.scaled_dot_product_attention` inside
    `sdpa_kernel(self.sdpa_backends, set_priority=True)`, which overrides global backend switches."""
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper

    return [m for m in model.modules() if isinstance(m, ScaledDotProductAttentionWrapper)]


def drop_cudnn_attention(model: nn.Module) -> Callable[[], None]:
    """Take cuDNN out of every SDPA module's backend list; returns the function that puts it back.

    cuDNN attention's backward is not deterministic even in deterministic mode (it only warns), and
    DTensor's strategy for it is broken on torch 2.11."""
    from torch.nn.attention import SDPBackend

    saved = [(m, m.sdpa_backends) for m in sdpa_wrappers(model)]
    for m, backends in saved:
        m.sdpa_backends = [b for b in backends if b != SDPBackend.CUDNN_ATTENTION]

    def restore() -> None:
        for m, backends in saved:
            m.sdpa_backends = backends

    return restore


def transformer_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The repeated blocks by their FQN (`layers.0`, ...): the unit of bucketing, AC and solving."""
    return {f"layers.{k}": m for k, m in model.layers.items()}


def nparams_and_flops_per_token(args: Any, model: nn.Module, seq_len: int) -> tuple[int, int]:
    return args.get_nparams_and_flops(model, seq_len)


def stage_costs(args: Any, model: nn.Module, seq_len: int) -> tuple[list[float], float, float]:
    """Training FLOPs per token of each transformer layer, of the embedding and of the output (final norm and
    projection), by torchtitan's count: 6 per active parameter (an MoE layer's routed experts by top_k of
    num_experts) and, per layer, attention's 6 * heads * seq * (query + value head dims). The embedding is a
    lookup. For a balanced pipeline split."""
    moe = getattr(args, "moe_args", None)
    active = moe.top_k / moe.num_experts if moe is not None else 1.0
    q = getattr(args, "qk_nope_head_dim", 0) + getattr(args, "qk_rope_head_dim", 0) or getattr(args, "head_dim", 0) or args.dim // args.n_heads
    attention = 6 * args.n_heads * seq_len * (q + (getattr(args, "v_head_dim", 0) or q))

    def flops(module: nn.Module | None) -> float:
        if module is None:
            return 0.0
        return 6.0 * sum(p.numel() * (active if ".experts." in f".{name}" else 1.0) for name, p in module.named_parameters())

    layers = [flops(block) + attention for block in model.layers.values()]
    return layers, 0.0, flops(model.norm) + flops(model.output)


def describe(args: Any) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if isinstance(getattr(args, f.name), (int, float, str))}
