"""A small byte-level BPE tokenizer for the long-tail task, saved as a Qwen2 tokenizer.

transformers 5 rebuilds ``Qwen2Tokenizer`` from ``vocab.json``/``merges.txt`` with its own
normalizer and pre-tokenizer, ignoring the pipeline stored in tokenizer.json. We therefore train
with exactly that pipeline (NFC, Qwen2 split regex, byte-level without its own regex), so the
tokenizer that verl and vLLM load encodes text identically to the one trained here. The Qwen2
regex keeps every digit a separate token, which keeps the arithmetic learnable.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from .longtail import generate_problems

# Same pattern as transformers' Qwen2Tokenizer (digits are matched one at a time by \p{N}).
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen-style template without a default system prompt: prompts stay short, and the generation
# prompt is exactly "<|im_start|>assistant\n" so SFT and rollout see the same prefix.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TARGET_VOCAB_SIZE = 512
# The task text only has a few hundred distinct mergeable pairs, so the trainer usually stops
# below the target; the model's embedding is padded to TARGET_VOCAB_SIZE either way.
TRAIN_PROBLEMS = 4000
TRAIN_SEED = 12345


def _empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def training_corpus(n: int = TRAIN_PROBLEMS, seed: int = TRAIN_SEED) -> list[str]:
    """Chat-formatted task text, as the model will see it."""
    return [
        f"{IM_START}user\n{p.prompt}{IM_END}\n{IM_START}assistant\n{p.solution}{IM_END}\n"
        for p in generate_problems(n, seed)
    ]


def train_bpe(corpus: list[str], vocab_size: int = TARGET_VOCAB_SIZE) -> Tokenizer:
    """Train byte-level BPE: all 256 byte symbols, merges, then the special tokens last."""
    tok = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Special tokens are stripped from the training text so no merge ever spans them.
    stripped = [_strip_specials(text) for text in corpus]
    tok.train_from_iterator(stripped, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _strip_specials(text: str) -> str:
    for special in SPECIAL_TOKENS:
        text = text.replace(special, "\n")
    return text


def _vocab_and_merges(tok: Tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    import json

    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    vocab = dict(model["vocab"])
    for special in SPECIAL_TOKENS:
        vocab[special] = tok.token_to_id(special)
    return vocab, merges


def build_tokenizer(out_dir: str | Path, corpus: list[str] | None = None):
    """Train, save to ``out_dir`` as a Qwen2 tokenizer, reload and verify. Returns the loaded tokenizer."""
    from transformers import AutoTokenizer, Qwen2Tokenizer

    out_dir = Path(out_dir)
    corpus = corpus if corpus is not None else training_corpus()
    trained = train_bpe(corpus)
    vocab, merges = _vocab_and_merges(trained)

    hf_tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(out_dir)

    loaded = AutoTokenizer.from_pretrained(out_dir)
    verify_tokenizer(loaded, trained, corpus[:200])
    return loaded


def verify_tokenizer(loaded, trained: Tokenizer, samples: list[str]) -> None:
    """Fail loudly if the saved tokenizer does not behave exactly like the trained one."""
    if type(loaded).__name__ != "Qwen2Tokenizer":
        raise RuntimeError(f"tokenizer loads as {type(loaded).__name__}, expected Qwen2Tokenizer")
    for text in samples:
        ids = loaded.encode(text, add_special_tokens=False)
        expected = trained.encode(text, add_special_tokens=False).ids
        if ids != expected:
            raise RuntimeError(f"saved tokenizer encodes differently from the trained one: {text[:80]!r}")
        if loaded.decode(ids) != text:
            raise RuntimeError(f"tokenizer does not round-trip: {text[:80]!r}")
    if len(loaded.encode("\n", add_special_tokens=False)) != 1:
        raise RuntimeError("'\\n' must be a single token")
    if loaded.eos_token != IM_END or loaded.pad_token != ENDOFTEXT:
        raise RuntimeError(f"unexpected eos/pad: {loaded.eos_token!r}/{loaded.pad_token!r}")
    for special in SPECIAL_TOKENS:
        if loaded.encode(special, add_special_tokens=False) != [loaded.convert_tokens_to_ids(special)]:
            raise RuntimeError(f"{special} is not a single special token")
    text = loaded.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    if text != f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n":
        raise RuntimeError(f"unexpected chat template output: {text!r}")
