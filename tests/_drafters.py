"""Test helpers: a tiny Llama target and EAGLE-1 drafters in vLLM's `eagle` layout, and EAGLE-3
parallel-drafting drafters (SD tests), the one-process reference of data-parallel drafter training
(`Interleaved`), and random captured records for the drafter tests.

The SD tests' drafters are built by hand, not trained: the SD tests check the engine, not the
trainer (the EAGLE-3 ones go through tlt_verl.drafter's export, the layout TLT serves).
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

VOCAB = 128


def write_target(out_dir: str, seed: int = 0, logit_scale: float = 3.0, context_scale: float = 0.3) -> str:
    """A random 2-layer Llama with a known, moderate entropy, written with its config.

    Mostly a bigram model: the token embedding dominates the residual stream and the layers add a
    `context_scale` share on top, so the next-token distribution also depends on the context.
    `logit_scale` sets the spread of the logits (about 2.1 nats of entropy at T=1 for 3.0; the bigram drafter is then accepted ~35-45% of the time).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    h = cfg.hidden_size
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.mlp.gate_proj, layer.mlp.up_proj):
                lin.weight.normal_(0, 1 / lin.in_features ** 0.5)
            for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                lin.weight.normal_(0, context_scale / lin.in_features ** 0.5)
        model.lm_head.weight.normal_(0, logit_scale / h ** 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def write_eagle1_drafter(target_dir: str, out_dir: str, *, bigram: bool, seed: int = 1) -> str:
    """An EAGLE-1 drafter for `target_dir`: random, or one that drafts the target's bigram guess.

    vLLM's EAGLE-1 Llama computes fc(cat(embed(x_{t+1}), h_t)), one decoder layer without input
    norm, and the target's lm_head. With fc = [I | 0] and the attention and MLP outputs zeroed the
    layer is the identity, so the drafter proposes argmax lm_head . embed(x_{t+1}): what a target
    dominated by its embedding would pick. It is accepted often but not always, so both branches
    of the rejection sampler run.
    """
    with open(os.path.join(target_dir, "config.json")) as f:
        tcfg = json.load(f)
    h, inter = tcfg["hidden_size"], tcfg["intermediate_size"]
    heads, kv = tcfg["num_attention_heads"], tcfg.get("num_key_value_heads", tcfg["num_attention_heads"])
    hd = tcfg.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    w = {
        "fc.weight": rand(h, 2 * h),
        "layers.0.self_attn.q_proj.weight": rand(heads * hd, h),
        "layers.0.self_attn.k_proj.weight": rand(kv * hd, h),
        "layers.0.self_attn.v_proj.weight": rand(kv * hd, h),
        "layers.0.self_attn.o_proj.weight": rand(h, heads * hd),
        "layers.0.mlp.gate_proj.weight": rand(inter, h),
        "layers.0.mlp.up_proj.weight": rand(inter, h),
        "layers.0.mlp.down_proj.weight": rand(h, inter),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
    }
    if bigram:
        w["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        w["layers.0.self_attn.o_proj.weight"].zero_()
        w["layers.0.mlp.down_proj.weight"].zero_()
    cfg = {k: tcfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                                "rope_theta", "bos_token_id", "eos_token_id") if k in tcfg}
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
               tie_word_embeddings=False, torch_dtype="float32")
    if "rope_parameters" in tcfg:
        cfg["rope_parameters"] = tcfg["rope_parameters"]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file({k: v.float().contiguous() for k, v in w.items()}, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def write_eagle3_parallel_drafter(target_dir: str, out_dir: str, *, bigram: bool, seed: int = 1,
                                  sharpness: float = 6.0) -> str:
    """An EAGLE-3 drafter for vLLM's parallel drafting (one forward drafts all k tokens): random,
    or one whose first draft is the target's bigram guess, like `write_eagle1_drafter`'s.

    EAGLE-3 reads the next token only through attention (its residual is fc of the target's aux
    features). With fc = 0, q = `sharpness` x k = v = the normed embedding and o_proj = I, each
    position attends to the positions holding its own token, so the layer returns that token's
    normed embedding and the target's LM head proposes argmax lm_head . embed(x_{t+1}). Mask
    positions likewise propose the bigram guess after the mask token: a fixed token, accepted when
    the target happens to sample it, so later drafts are mostly rejected and resampled.
    """
    from transformers import AutoConfig

    from tlt_verl.drafter import DrafterConfig, build_drafter
    from tlt_verl.drafter.export import export_drafter

    w = load_file(os.path.join(target_dir, "model.safetensors"))
    cfg = DrafterConfig.from_target(AutoConfig.from_pretrained(target_dir), kind="eagle3", parallel_drafting=True)
    torch.manual_seed(seed)
    drafter = build_drafter(cfg, w["model.embed_tokens.weight"], w["lm_head.weight"])
    if bigram:
        h = cfg.hidden_size
        attn = drafter.layers[0].self_attn
        pick = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)   # the embedding half of cat(embed, g)
        with torch.no_grad():
            drafter.fc.weight.zero_()
            attn.q_proj.weight.copy_(sharpness * pick)
            attn.k_proj.weight.copy_(pick)
            attn.v_proj.weight.copy_(pick)
            attn.o_proj.weight.copy_(torch.eye(h))
            drafter.layers[0].mlp.down_proj.weight.zero_()
    return str(export_drafter(drafter, out_dir))


def bigram_guess(target_dir: str) -> torch.Tensor:
    """The token the bigram drafter proposes after each token (for checking acceptance by hand)."""
    w = load_file(os.path.join(target_dir, "model.safetensors"))
    return (w["model.embed_tokens.weight"] @ w["lm_head.weight"].T).argmax(-1)


class Interleaved:
    """One process's view of two ranks' buffers: micro-batches alternate A, B, A, B ...

    What data parallel over those ranks computes, accumulated in one process (the reference the
    DP tests compare against)."""

    def __init__(self, *buffers):
        self.buffers = buffers

    def sample_batches(self, max_tokens, cursor=None, **kw):
        its = [b.sample_batches(max_tokens, **kw) for b in self.buffers]
        while True:
            for it in its:
                yield next(it)[0], {}


def captured_records(target, n: int, vocab: int, *, seed: int = 0, kind: str = "eagle", lengths=(6, 20)):
    """Hidden-state records of ``n`` random sequences (first 3 tokens prompt) through ``target``."""
    from tlt_verl.capture import capture_samples
    from tlt_verl.drafter import DrafterConfig

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (int(torch.randint(*lengths, (1,), generator=g)),), generator=g)
            for _ in range(n)]
    aux = DrafterConfig.from_target(target.config, kind="eagle3").aux_layer_ids if kind == "eagle3" else ()
    return capture_samples(target, seqs, [3] * n, aux_layer_ids=aux)
