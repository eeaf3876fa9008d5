"""Drafter folders that serving engines load (``config.json`` + ``model.safetensors``), and
loading them back (or warm-starting from a public EAGLE folder).

Layouts (see the eagle-checkpoint-formats note):
- ``vllm`` / eagle: a plain ``LlamaConfig`` with ``architectures: ["LlamaForCausalLM"]`` and one
  layer (vLLM renames it to ``EagleLlamaForCausalLM`` for ``method="eagle"``); no embedding or
  LM head in the weights, so vLLM shares the target's.
- ``sglang`` / eagle: ``LlamaForCausalLMEagle``, plus an explicit zero ``fc.bias``: SGLang's fc
  has a bias and its loader does not report missing keys, so leaving it out would leave it
  uninitialised.
- eagle3 (both engines): ``LlamaForCausalLMEagle3`` with ``draft_vocab_size``,
  ``target_hidden_size`` and the aux layer ids; ``d2t``/``t2d`` only for a reduced vocabulary
  (vLLM has no ``draft_id_to_target_id`` parameter to load them into otherwise).
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from . import build_drafter
from .config import DrafterConfig


@dataclass(frozen=True)
class Layout:
    architecture: str
    zero_fc_bias: bool = False


LAYOUTS: dict[tuple[str, str], Layout] = {
    ("vllm", "eagle"): Layout("LlamaForCausalLM"),
    ("sglang", "eagle"): Layout("LlamaForCausalLMEagle", zero_fc_bias=True),
    ("vllm", "eagle3"): Layout("LlamaForCausalLMEagle3"),
    ("sglang", "eagle3"): Layout("LlamaForCausalLMEagle3"),
}

# Architectures a drafter folder may declare, and the drafter kind each one is.
ARCHITECTURE_KINDS = {
    "LlamaForCausalLM": "eagle", "EagleLlamaForCausalLM": "eagle",
    "LlamaForCausalLMEagle": "eagle", "Qwen2ForCausalLMEagle": "eagle",
    "LlamaForCausalLMEagle3": "eagle3", "Eagle3LlamaForCausalLM": "eagle3",
}


def drafter_config_json(cfg: DrafterConfig, layout: Layout, dtype: torch.dtype) -> dict:
    llama = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=1,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=cfg.attention_bias, tie_word_embeddings=False,
    )
    out = llama.to_dict()
    out.update(architectures=[layout.architecture], model_type="llama",
               dtype=str(dtype).removeprefix("torch."))
    if cfg.kind == "eagle3":
        ids = list(cfg.aux_layer_ids)
        out.update(draft_vocab_size=cfg.draft_vocab, target_hidden_size=cfg.target_hidden_size,
                   norm_before_residual=False, eagle_aux_hidden_state_layer_ids=ids,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True})
    if cfg.parallel_drafting:
        # vLLM reads the mask slots' token here; the folder is served with parallel_drafting on.
        out["mask_token_id"] = cfg.mask_token_id
    # Engines ignore this; load_drafter uses it to check the target.
    out["tlt_drafter"] = {"kind": cfg.kind, "target_num_layers": cfg.target_num_layers,
                          "parallel_drafting": cfg.parallel_drafting}
    return out


def export_drafter(drafter, out_dir: str | Path, engine: str = "vllm") -> Path:
    """Write ``drafter`` as a folder ``engine`` ("vllm" or "sglang") loads as its draft model."""
    cfg: DrafterConfig = drafter.cfg
    layout = LAYOUTS.get((engine, cfg.kind))
    if layout is None:
        raise ValueError(f"export_drafter: engine={engine!r}: known engines "
                         f"{sorted({e for e, _ in LAYOUTS})}")
    weights = {k: v.detach().contiguous().clone() for k, v in drafter.state_dict().items()}
    if cfg.kind == "eagle3" and cfg.draft_vocab == cfg.vocab_size:
        weights.pop("d2t"), weights.pop("t2d")
    if layout.zero_fc_bias:
        weights["fc.bias"] = torch.zeros(cfg.hidden_size, dtype=drafter.fc.weight.dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = drafter_config_json(cfg, layout, drafter.fc.weight.dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


# ---------------------------------------------------------------------------- loading

def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").exists():
        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").exists():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"drafter {folder}: no model.safetensors or pytorch_model.bin")


def _config_and_kind(folder: Path) -> tuple[dict, str]:
    try:
        d = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"drafter {folder}: no config.json") from None
    arch = (d.get("architectures") or [None])[0]
    kind = ARCHITECTURE_KINDS.get(arch)
    if kind is None:
        raise ValueError(f"drafter {folder}: architecture {arch!r} is not an EAGLE drafter "
                         f"(known: {', '.join(ARCHITECTURE_KINDS)})")
    return d, kind


def folder_kind(path: str | Path) -> str:
    """The drafter kind (eagle, eagle3) of an exported folder, from its architecture."""
    return _config_and_kind(Path(path))[1]


def read_drafter_config(path: str | Path, target_config) -> DrafterConfig:
    """The drafter folder's config, checked against the target's; one-line ValueError naming the
    first mismatch."""
    folder = Path(path)
    d, kind = _config_and_kind(folder)
    if d.get("num_hidden_layers") != 1:
        raise ValueError(f"drafter {folder}: num_hidden_layers={d.get('num_hidden_layers')}, "
                         f"only one-layer drafters are supported")
    for key in ("vocab_size", "hidden_size"):
        if d.get(key) != getattr(target_config, key):
            raise ValueError(f"drafter {folder}: {key}={d.get(key)} does not match the target's "
                             f"{key}={getattr(target_config, key)}")
    L = target_config.num_hidden_layers
    aux, draft_vocab = (), None
    if kind == "eagle3":
        if d.get("target_hidden_size", d["hidden_size"]) != target_config.hidden_size:
            raise ValueError(f"drafter {folder}: target_hidden_size={d.get('target_hidden_size')} "
                             f"does not match the target's hidden_size={target_config.hidden_size}")
        aux = (d.get("eagle_aux_hidden_state_layer_ids")
               or (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
        if not aux:
            raise ValueError(f"drafter {folder}: eagle3 config names no "
                             f"eagle_aux_hidden_state_layer_ids (engines would guess them)")
        if any(not 0 <= k < L for k in aux):
            raise ValueError(f"drafter {folder}: eagle_aux_hidden_state_layer_ids={list(aux)} out "
                             f"of range for a target with {L} layers")
        dv = d.get("draft_vocab_size")
        draft_vocab = dv if dv and dv != d["vocab_size"] else None
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"drafter {folder}: rope_type={rope.get('rope_type')!r}, only 'default' "
                         f"rotary is supported")
    heads = d["num_attention_heads"]
    return DrafterConfig(
        kind=kind, hidden_size=d["hidden_size"], num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
        target_num_layers=L, target_hidden_size=target_config.hidden_size,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        hidden_act=d.get("hidden_act", "silu"), attention_bias=bool(d.get("attention_bias", False)),
        aux_layer_ids=tuple(aux), draft_vocab_size=draft_vocab,
        parallel_drafting=parallel_drafting(d), mask_token_id=d.get("mask_token_id") if parallel_drafting(d) else None,
    )


def parallel_drafting(config_json: dict) -> bool:
    """Whether a drafter folder's config.json was trained for parallel drafting (an engine must
    then serve it with speculative_config.parallel_drafting)."""
    return bool((config_json.get("tlt_drafter") or {}).get("parallel_drafting"))


def folder_parallel_drafting(folder: str | Path) -> bool:
    """`parallel_drafting` of a drafter folder (False for a folder without our config)."""
    try:
        return parallel_drafting(json.loads((Path(folder) / "config.json").read_text()))
    except (OSError, ValueError):
        return False


def _normalise_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Public EAGLE folders: ``model.`` prefixes and EAGLE-3's legacy ``midlayer.``."""
    out = {}
    for name, t in weights.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        out[name] = t
    return out


def load_drafter(path: str | Path, target_config, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, *, warm_start: bool = False):
    """A drafter from a folder, bound to the target's embedding and LM head.

    Strict by default (the folders ``export_drafter`` writes): every weight must be there and
    nothing else. ``warm_start=True`` imports a public EAGLE folder: it drops the embedding /
    LM head copies the drafter takes from the target, a trained ``fc.bias`` (the vLLM layout
    has none; a warning says so) and starts a missing EAGLE-3 ``lm_head`` from the target."""
    folder = Path(path)
    cfg = read_drafter_config(folder, target_config)
    drafter = build_drafter(cfg, embed_weight, lm_head_weight)
    weights = _normalise_names(_read_weights(folder))
    own = drafter.state_dict()

    bias = weights.pop("fc.bias", None)
    if bias is not None and bool(bias.abs().max() > 0):
        if not warm_start:
            raise ValueError(f"drafter {folder}: fc.bias is nonzero and this drafter's fc has no "
                             f"bias (load with warm_start=True to drop it)")
        warnings.warn(f"drafter {folder}: dropping a nonzero fc.bias (warm start)")
    for name in ("embed_tokens.weight", "lm_head.weight") if cfg.kind == "eagle" else ("embed_tokens.weight",):
        if name in weights and warm_start:
            weights.pop(name)
    if cfg.kind == "eagle3":
        if "d2t" in weights and "t2d" not in weights:
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[torch.arange(cfg.draft_vocab) + weights["d2t"]] = True
            weights["t2d"] = t2d
        if cfg.draft_vocab == cfg.vocab_size:
            weights.setdefault("d2t", own["d2t"])
            weights.setdefault("t2d", own["t2d"])
        if warm_start and "lm_head.weight" not in weights:
            weights["lm_head.weight"] = drafter.target_head_rows().clone()

    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    if missing or unexpected:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"unexpected {', '.join(unexpected)}"] if unexpected else [])
        raise ValueError(f"drafter {folder}: weights do not fit a {cfg.kind} drafter: {'; '.join(parts)}")
    for name, t in weights.items():
        if t.shape != own[name].shape:
            raise ValueError(f"drafter {folder}: {name} has shape {tuple(t.shape)}, the config "
                             f"implies {tuple(own[name].shape)}")
    drafter.load_state_dict(weights)
    return drafter
