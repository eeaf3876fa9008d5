"""A tiny randomly initialised Qwen2 causal LM that trains in minutes on a 2-core CPU."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 128
    num_hidden_layers: int = 4
    # vLLM's CPU attention backend needs head_dim 32 or 64. Four 32-dim heads rather than two
    # 64-dim ones: more independent attention patterns made the prompt look-up learn faster.
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)


# Embedding rows are padded to a multiple of this so matmul shapes stay friendly; the extra
# rows are never produced by the tokenizer.
VOCAB_MULTIPLE = 64


def padded_vocab_size(num_tokens: int) -> int:
    return -(-num_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def tiny_qwen2_config(tokenizer, spec: TinyModelSpec = TinyModelSpec()):
    """Qwen2Config for ``spec`` with vocab and special-token ids taken from ``tokenizer``."""
    from transformers import Qwen2Config

    if spec.head_dim not in (32, 64):
        raise ValueError(f"head_dim must be 32 or 64 for vLLM's CPU attention, got {spec.head_dim}")
    return Qwen2Config(
        vocab_size=padded_vocab_size(len(tokenizer)),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def build_tiny_model(tokenizer, spec: TinyModelSpec = TinyModelSpec(), seed: int = 0):
    """Randomly initialised fp32 ``Qwen2ForCausalLM``; deterministic for a given seed."""
    import torch
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(tokenizer, spec)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    return model


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
