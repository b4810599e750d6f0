"""Hugging Face checkpoints in and out: safetensors with HF tensor names plus a `config.json`.

Names and layouts are translated by torchtitan's state-dict adapter of the model family
(`ModelSpec.hf_adapter`: Llama 3's q/k row permutation, per-expert HF tensors <-> our stacked
expert weights). Loading goes through DCP with the HF storage reader: the adapter turns the placed
model's DTensors into HF-named DTensors, so every rank requests only the slices its shards hold and
reads them straight from the safetensors files, on any mesh. Saving runs the same translation the
other way through DCP's HF storage writer (each rank writes its shards, rank 0 consolidates them).

Shapes are checked against the safetensors headers before any process group exists
(`check_hf_folder`), so another architecture or size stops with one line naming the first tensor
that differs. A DCP step folder of our own can also seed a run (`load_initial` without
`in_hf`): its model weights are loaded, nothing else.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate

from .checkpoint import CheckpointError, check_same_model, read_meta, state_shapes
from .models import ModelSpec

logger = logging.getLogger("graph_trainer")

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
_SUFFIX = ".safetensors"
# Tensors HF checkpoints may carry that no model here has a place for (recomputed, not learned).
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")
_TIED = ("lm_head.weight", "model.embed_tokens.weight")
_CORRECTION_BIAS = ".mlp.gate.e_score_correction_bias"


def adapter(spec: ModelSpec, args: Any):
    if spec.hf_adapter is None:
        raise CheckpointError(f"{spec.name} has no Hugging Face state-dict adapter")
    return spec.hf_adapter(args, None)


def expected_hf_shapes(spec: ModelSpec, model: nn.Module, args: Any) -> dict[str, list[int]]:
    """HF name -> shape of every tensor this model reads from or writes to an HF checkpoint
    (computed on the meta-device model, so it costs no memory)."""
    return {k: list(v.shape) for k, v in adapter(spec, args).to_hf(model.state_dict()).items()}


def hf_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF checkpoint: the ones its index names, else every one in the folder."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"HF checkpoint {folder} has an unreadable {INDEX_FILE} ({e})") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(f"HF checkpoint {folder} is incomplete: {missing[0]}, named in {INDEX_FILE}, is missing")
        return [folder / n for n in names]
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_SUFFIX))


def read_hf_shapes(folder: Path) -> dict[str, list[int]]:
    """HF name -> shape of every tensor in the checkpoint, from the safetensors headers alone."""
    from safetensors import safe_open

    if not folder.is_dir():
        raise CheckpointError(f"HF checkpoint folder {folder} does not exist; pass the folder that holds the .safetensors files")
    files = hf_files(folder)
    if not files:
        raise CheckpointError(f"{folder} holds no .safetensors files; pass a Hugging Face checkpoint folder")
    shapes: dict[str, list[int]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = list(f.get_slice(key).get_shape())
        except Exception as e:  # noqa: BLE001  (safetensors raises its own error types for damaged headers)
            raise CheckpointError(f"HF checkpoint file {file} is unreadable ({e})") from None
    return shapes


def tied_output(saved: dict[str, list[int]], expected: dict[str, list[int]]) -> bool:
    """A checkpoint of a tied model (no lm_head) whose embedding seeds our separate output projection."""
    head, embed = _TIED
    return head in expected and head not in saved and embed in saved and saved[embed] == expected[head]


def first_mismatch(saved: dict[str, list[int]], expected: dict[str, list[int]]) -> str | None:
    """The first tensor (in this model's order) that is missing or shaped differently, else the
    first one the checkpoint holds that this model lacks; None when they match."""
    for name, shape in expected.items():
        if name not in saved:
            if name == _TIED[0] and tied_output(saved, expected):
                continue
            return f"it lacks {name} (shape {shape} here)"
        if saved[name] != shape:
            return f"{name} has shape {saved[name]} there and {shape} here"
    extra = [k for k in saved if k not in expected and not _IGNORED.search(k)]
    if extra:
        return f"it holds {extra[0]}, which this model lacks"
    return None


def check_hf_folder(folder: Path, spec: ModelSpec, model: nn.Module, args: Any, what: str) -> None:
    """Refuse an HF checkpoint of another architecture or size, naming the first differing tensor."""
    problem = first_mismatch(read_hf_shapes(folder), expected_hf_shapes(spec, model, args))
    if problem:
        raise CheckpointError(
            f"HF checkpoint {folder} does not fit {what} ({problem}); load a checkpoint of this architecture and size, "
            "or pick the matching --model.name / --model.flavor / --model.n_layers"
        )


def check_dcp_folder(folder: Path, model: nn.Module, what: str) -> None:
    """A DCP step folder given as --checkpoint.initial_load_path: complete, and of this model."""
    check_same_model(folder, read_meta(folder), state_shapes(model.state_dict()), what)


def _options() -> StateDictOptions:
    return StateDictOptions(strict=False)


def _without_replicated_dims(state: dict[str, Any]) -> dict[str, Any]:
    """Stacked expert weights as the same local shards on the mesh dims that split them.

    torchtitan's adapter cuts a DTensor of stacked experts into per-expert tensors from its `Shard`
    placements and fails on a `Replicate` one (which our meshes have, e.g. on dp_replicate or tp);
    a replicated dim changes nothing about which experts or slices a rank holds, so it is dropped.
    """
    out = dict(state)
    for k, v in state.items():
        if ".moe.experts." not in k or not isinstance(v, DTensor):
            continue
        kept = [(n, p) for n, p in zip(v.device_mesh.mesh_dim_names, v.placements) if not isinstance(p, Replicate)]
        if not kept:
            out[k] = v.to_local()
            continue
        mesh = v.device_mesh[tuple(n for n, _ in kept)]
        out[k] = DTensor.from_local(v.to_local(), mesh, [p for _, p in kept], run_check=False, shape=v.shape, stride=v.stride())
    return out


def _on_model_layouts(loaded: dict[str, Any], model_state: dict[str, Any]) -> dict[str, Any]:
    """Put tensors that `_without_replicated_dims` took off their mesh back on the parameter's own."""
    out = dict(loaded)
    for k, v in loaded.items():
        target = model_state.get(k)
        if not isinstance(target, DTensor) or (isinstance(v, DTensor) and v.device_mesh == target.device_mesh):
            continue
        local = v.to_local() if isinstance(v, DTensor) else v
        out[k] = DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,
                                    shape=target.shape, stride=target.stride())
    return out


@torch.no_grad()
def load_hf(model: nn.Module, spec: ModelSpec, args: Any, folder: Path) -> None:
    """Fill the placed, materialised model's weights from an HF checkpoint (collective)."""
    conv = adapter(spec, args)
    state = get_model_state_dict(model, options=_options())
    hf = conv.to_hf(_without_replicated_dims(state))
    saved = read_hf_shapes(folder)
    head = hf.pop(_TIED[0]) if tied_output(saved, {k: list(v.shape) for k, v in hf.items()}) else None
    dcp.load(hf, storage_reader=HuggingFaceStorageReader(str(folder)))
    if head is not None:
        # A second read: DCP fills each requested name once, and the output projection has its own layout.
        tied = {_TIED[1]: head}
        dcp.load(tied, storage_reader=HuggingFaceStorageReader(str(folder)))
        hf[_TIED[0]] = tied[_TIED[1]]
    set_model_state_dict(model, _on_model_layouts(conv.from_hf(hf), state), options=_options())


@torch.no_grad()
def load_dcp_model(model: nn.Module, folder: Path) -> None:
    """The model weights (and persistent buffers) of one of our DCP step folders; nothing else (collective)."""
    state = {"model": get_model_state_dict(model, options=_options())}
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"], options=_options())


def load_initial(model: nn.Module, spec: ModelSpec, args: Any, folder: Path, in_hf: bool) -> None:
    try:
        if in_hf:
            load_hf(model, spec, args, folder)
        else:
            load_dcp_model(model, folder)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001  (whatever DCP or the adapter raises, the folder is what to name)
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"initial checkpoint {folder} cannot be loaded ({reason})") from e


def rope_scaling(spec: ModelSpec, args: Any) -> dict[str, Any] | None:
    """The RoPE scaling torchtitan applies, in the form `transformers` reads from config.json.

    Llama 3 always scales its frequencies. DeepSeek applies YaRN, and the attention's mscale that goes
    with it, only when the model was built for sequences longer than `original_seq_len`; torchtitan
    scales the softmax by mscale^2 but leaves cos/sin alone, hence `mscale_all_dim` and an
    `attention_factor` of 1. Qwen3 does not scale."""
    if spec.name == "llama3":
        r = args.rope_scaling_args
        return {"rope_type": "llama3", "factor": r.scaling_factor, "low_freq_factor": r.low_freq_factor,
                "high_freq_factor": r.high_freq_factor, "original_max_position_embeddings": r.original_max_position_embeddings}
    if spec.name == "deepseek_v3" and args.max_seq_len > args.original_seq_len:
        return {"rope_type": "yarn", "factor": args.rope_factor, "original_max_position_embeddings": args.original_seq_len,
                "beta_fast": args.beta_fast, "beta_slow": args.beta_slow, "mscale": args.mscale, "mscale_all_dim": args.mscale,
                "attention_factor": 1.0}
    return None


def _deepseek_routing(moe: Any) -> dict[str, Any]:
    """DeepSeek V3's sigmoid router is `DeepseekV3ForCausalLM`'s; the softmax router of the smaller
    flavors (DeepSeek-V2 shapes) is `DeepseekV2ForCausalLM`'s (see `_v2_lacks` for what it cannot hold)."""
    groups = {"n_group": moe.num_expert_groups or 1, "topk_group": moe.num_limited_groups or 1}
    if moe.score_func == "sigmoid":
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "norm_topk_prob": moe.route_norm,
                "rope_interleave": True, **groups}
    return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "norm_topk_prob": moe.route_norm,
            "topk_method": "group_limited_greedy" if moe.num_expert_groups else "greedy", **groups}


def hf_config(spec: ModelSpec, args: Any, flavor: str, shapes: dict[str, list[int]]) -> dict[str, Any]:
    """config.json in the field names of the HF model class of the family, plus a `graph_trainer`
    entry naming the model as this package knows it."""
    common = {
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "vocab_size": args.vocab_size, "max_position_embeddings": spec.flavors[flavor].max_seq_len, "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling(spec, args),
        "rms_norm_eps": getattr(args, "norm_eps", 1e-6), "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    moe = getattr(args, "moe_args", None)
    if spec.name == "llama3":
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "num_key_value_heads": args.n_kv_heads or args.n_heads, "head_dim": args.dim // args.n_heads,
                  "intermediate_size": shapes["model.layers.0.mlp.gate_proj.weight"][0]}
    elif spec.name == "qwen3":
        config = {"num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "intermediate_size": args.hidden_dim}
        if args.moe_enabled:
            config.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                           "moe_intermediate_size": args.moe_inter_dim, "num_experts": moe.num_experts,
                           "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.route_norm,
                           "decoder_sparse_step": 1, "mlp_only_layers": []})
        else:
            config.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    else:
        config = {"num_key_value_heads": args.n_heads, "intermediate_size": args.inter_dim,
                  "moe_intermediate_size": args.moe_inter_dim, "n_routed_experts": moe.num_experts,
                  "n_shared_experts": moe.num_shared_experts, "num_experts_per_tok": moe.top_k,
                  "first_k_dense_replace": args.n_dense_layers, "q_lora_rank": args.q_lora_rank or None,
                  "kv_lora_rank": args.kv_lora_rank, "qk_nope_head_dim": args.qk_nope_head_dim,
                  "qk_rope_head_dim": args.qk_rope_head_dim, "v_head_dim": args.v_head_dim,
                  "routed_scaling_factor": moe.route_scale, **_deepseek_routing(moe)}
    return {**common, **config, "graph_trainer": {"model": spec.name, "flavor": flavor, "n_layers": args.n_layers}}


def _dropped_on_export(state: dict[str, Any], conv: Any) -> list[str]:
    """Our tensors the HF format of the family has no name for."""
    dropped = []
    for k, v in state.items():
        try:
            kept = conv.to_hf({k: torch.empty(v.shape, device="meta")})
        except KeyError:
            kept = {}
        if not kept:
            dropped.append(k)
    return dropped


def _v2_lacks(config: dict[str, Any], names: list[str]) -> list[str]:
    """What of torchtitan's softmax routing HF's DeepseekV2 router does not compute. The load-balancing
    bias stays in the files (our own loads get it back) though DeepseekV2 does not read it."""
    if config["model_type"] != "deepseek_v2":
        return []
    biased = sum(name.endswith(_CORRECTION_BIAS) for name in names)
    lacks = [f"the load-balancing bias of {biased} layers (saved, but not read by it)"] if biased else []
    if config.get("topk_method") == "group_limited_greedy":
        lacks.append("torchtitan's ranking of expert groups by their best two scores (it takes the best one)")
    return lacks


def _move_into(tmp: Path, out: Path) -> None:
    """`tmp` becomes `out`. A folder that exists keeps its identity and only has its contents replaced:
    it may be a shell's working folder (`export --out .`), which a removal would leave deleted under it."""
    if not out.is_dir():
        tmp.rename(out)
        return
    for old in out.iterdir():
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    for new in tmp.iterdir():
        new.rename(out / new.name)
    tmp.rmdir()


def save_hf(model: nn.Module, spec: ModelSpec, args: Any, flavor: str, out: Path) -> Path:
    """Write `out/` (via `out.tmp/`, renamed when complete): one consolidated `model.safetensors`
    with HF names and `config.json`. Collective when a process group exists."""
    conv = adapter(spec, args)
    state = get_model_state_dict(model, options=_options())
    hf = conv.to_hf(_without_replicated_dims(state))
    config = hf_config(spec, args, flavor, {k: list(v.shape) for k, v in hf.items()})
    distributed = dist.is_initialized()
    rank0 = not distributed or dist.get_rank() == 0
    tmp = out.with_name(out.name + ".tmp")
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if distributed:
        dist.barrier()
    dcp.save(hf, storage_writer=HuggingFaceStorageWriter(str(tmp), save_distributed=True, enable_consolidation=True),
             no_dist=not distributed)
    if rank0:
        shutil.rmtree(tmp / "sharded", ignore_errors=True)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
        dropped = _dropped_on_export(state, conv)
        if dropped:
            logger.warning(f"the Hugging Face format of {spec.name} has no place for {', '.join(dropped[:3])}"
                           f"{' and more' if len(dropped) > 3 else ''}: not saved in {out}")
        lacks = _v2_lacks(config, list(hf))
        if lacks:
            logger.warning(f"DeepseekV2ForCausalLM (the softmax router of {spec.name} {flavor}) lacks {' and '.join(lacks)}: "
                           f"where they decide which experts a token goes to, {out} picks others than we trained with")
        _move_into(tmp, out)
        logger.info(f"saved Hugging Face checkpoint {out}")
    if distributed:
        dist.barrier()
    return out


_MODEL_DESCRIPTION = re.compile(r"^(\S+) (\S+) n_layers=(\d+)$")


def _is_export(folder: Path) -> bool:
    """An earlier export and nothing else: our config.json and only the files an export writes."""
    written = all(p.is_file() and (p.name in (CONFIG_FILE, INDEX_FILE) or p.name.endswith(_SUFFIX)) for p in folder.iterdir())
    try:
        return written and "graph_trainer" in json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return False


def check_export_target(folder: Path, out: Path, overwrite: bool) -> None:
    """Refuse an output folder whose replacement would delete checkpoints or someone's files: one that
    is, holds or lies inside the step folder or its checkpoint root (the other steps live there), or a
    non-empty folder that is not an earlier export, unless `overwrite`."""
    source, target = folder.resolve(), out.resolve()
    root = source.parent
    relation = None
    if target in (source, root):
        relation, guarded = "is", target
    elif source.is_relative_to(target):
        relation, guarded = "holds", source
    elif target.is_relative_to(root):
        relation, guarded = "lies inside", source if target.is_relative_to(source) else root
    if relation:
        raise CheckpointError(f"--out {out} {relation} the checkpoint folder {guarded}, and an export replaces its output folder; "
                              f"pass a folder outside {root}")
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"--out {out} is a file; pass a folder")
    if target.is_dir() and any(target.iterdir()) and not _is_export(target) and not overwrite:
        raise CheckpointError(f"--out {out} is a non-empty folder that is not an earlier export; "
                              "pass an empty or new folder, or --overwrite to replace it")


def export(folder: Path, out: Path, overwrite: bool = False) -> Path:
    """One of our DCP step folders -> an HF checkpoint, in this process alone (the whole model is
    held in host memory once). The vocabulary is the checkpoint's (a tokenizer's, padded), not the flavor's."""
    from . import models

    check_export_target(folder, out, overwrite)
    meta = read_meta(folder)
    m = _MODEL_DESCRIPTION.match(str(meta.get("model", "")))
    if not m or m.group(1) not in models.model_names():
        raise CheckpointError(f"checkpoint {folder} does not say which model it holds; export a checkpoint written by graph-trainer train")
    name, flavor, n_layers = m.group(1), m.group(2), int(m.group(3))
    spec = models.get_spec(name)
    if flavor not in spec.flavors:
        raise CheckpointError(f"checkpoint {folder} holds {name} {flavor}, a flavor this version does not know")
    vocab = meta.get("params", {}).get("tok_embeddings.weight", [0])[0]
    args = spec.args_for(flavor, int(meta.get("seq_len", 2048)), n_layers, vocab_size=vocab)
    model = models.build_on_meta(spec, args, "cpu")
    check_dcp_folder(folder, model, f"{name} {flavor}")
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    model.load_state_dict(state["model"], strict=False)
    # resolved: the temporary folder is named after the output's name, which `--out .` lacks
    return save_hf(model, spec, args, flavor, out.resolve())
