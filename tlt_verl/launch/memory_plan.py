"""Per-GPU memory plan of a GPU recipe: what verl's actor, vLLM and TLT's drafter hold on each
card, in the two phases of a synchronous colocated RL step, and whether the larger one fits.

    python -m tlt_verl.launch.memory_plan recipes/qwen2.5_7b_grpo_8gpu.sh            # print the table
    python -m tlt_verl.launch.memory_plan --write recipes/qwen2.5_7b_grpo_8gpu.sh    # rewrite its block

Inputs: the model's shapes and the card (named on the recipe's `# memory-plan:` line), and the
recipe's own `key=value` overrides of `verl.trainer.main_ppo` (verl 0.9.1's defaults for the
rest). Nothing is imported from verl or vLLM: the table is arithmetic, and docs/memory.md says
where each term comes from in their code. The two phases:

  training: vLLM asleep (level 2: weights and KV cache released), the actor's update runs;
  rollout:  vLLM awake with its whole `gpu_memory_utilization` share, the drafter trains on
            drained ranks; the actor keeps on the GPU whatever its offload flags leave there.

The peak is the larger of the two, not their sum: that is what sleep mode buys. Terms marked as
assumptions in `Assumptions` are estimates to check on a card (docs/memory.md lists how).
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

GiB = 1 << 30
BEGIN = "# >>> memory plan"
END = "# <<< memory plan <<<"


# ---------------------------------------------------------------------------- model and card

@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False          # tie_word_embeddings
    qkv_bias: bool = True       # Qwen2 has biases on q, k and v (not o)
    explicit_head_dim: int | None = None   # config.json's head_dim, where it is not hidden / heads

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "") -> "ModelShape":
        """The shape in a Hugging Face ``config.json`` (a dict)."""
        heads = cfg["num_attention_heads"]
        return cls(name or cfg.get("_name_or_path", ""), hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
                   intermediate=cfg["intermediate_size"], heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
                   vocab=cfg["vocab_size"], tied=bool(cfg.get("tie_word_embeddings", False)),
                   explicit_head_dim=cfg.get("head_dim"))

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1, extra_layers: int = 0) -> int:
        """K and V of one token on one of ``tp`` shards, for the layers plus ``extra_layers`` (a
        drafter's layer keeps its own KV)."""
        return 2 * (self.layers + extra_layers) * max(1, self.kv_heads // tp) * self.head_dim * dtype_bytes

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        attn = 2 * h * h + 2 * h * kv + (h + 2 * kv if self.qkv_bias else 0)
        return attn + 3 * h * self.intermediate + 2 * h        # + two RMSNorms

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.embed_params + self.lm_head_params + self.layers * self.layer_params + self.hidden


# From the models' config.json. Known totals: 7.62B and 32.76B (tests/test_recipe_memory.py).
MODELS = {m.name: m for m in (
    ModelShape("Qwen2.5-7B", hidden=3584, layers=28, intermediate=18944, heads=28, kv_heads=4, vocab=152064),
    ModelShape("Qwen2.5-32B", hidden=5120, layers=64, intermediate=27648, heads=40, kv_heads=8, vocab=152064),
)}


@dataclass(frozen=True)
class Card:
    name: str
    total: int                  # bytes, as cudaMemGetInfo reports them: vLLM's utilization is of this


# An H100 80GB reports 79.1-79.3 GiB total to CUDA depending on driver and ECC; the low end.
CARDS = {"H100-80GB": Card("H100 80GB", int(79.1 * GiB))}


# ---------------------------------------------------------------------------- what the recipe sets

@dataclass(frozen=True)
class Settings:
    """The recipe's choices that decide GPU memory; defaults are verl 0.9.1's (trainer/config)."""
    gpus_per_node: int = 8
    nodes: int = 1
    strategy: str = "fsdp"
    param_offload: bool = False
    optimizer_offload: bool = False
    gradient_checkpointing: bool = True
    sequence_parallel: int = 1             # actor (and ref) fsdp_config.ulysses_sequence_parallel_size
    ref_sequence_parallel: int = 1
    use_dynamic_bsz: bool = False
    log_prob_dynamic_bsz: bool | None = None        # rollout / ref log_prob_use_dynamic_bsz (default: the actor's)
    ref_log_prob_dynamic_bsz: bool | None = None
    ppo_tokens_per_gpu: int = 16384        # actor.ppo_max_token_len_per_gpu
    log_prob_tokens_per_gpu: int | None = None      # rollout.log_prob_max_token_len_per_gpu
    ref_log_prob_tokens_per_gpu: int | None = None  # ref.log_prob_max_token_len_per_gpu (default: the actor's)
    entropy_in_update: bool = False        # actor.entropy_coeff != 0 or actor.calculate_entropy
    use_kl_loss: bool = False
    max_prompt: int = 512
    max_response: int = 512
    rollout_name: str = "vllm"
    tp: int = 2
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    free_cache_engine: bool = True         # sleep while the actor trains
    rollout_dtype_bytes: int = 2           # rollout.dtype bfloat16
    tlt: bool = False
    drafter_kind: str = "eagle"            # tlt.drafter.kind; unset with init=scratch: eagle
    drafter_tokens_per_micro: int = 4096   # tlt.drafter.trainer.tokens_per_micro
    train_drafter: bool = True             # tlt.spot.train_drafter: auto is true on GPU
    drafter_buffer_bytes: int = 256 << 20  # tlt.drafter.buffer.budget_bytes (host RAM)
    sd_max_k: int = 3                      # max(tlt.sd.bandit.arms): vLLM's num_speculative_tokens

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def max_len(self) -> int:
        return self.max_prompt + self.max_response


def _bool(v: str) -> bool:
    if v.lower() not in ("true", "false"):
        raise ValueError(f"expected True or False, got {v!r}")
    return v.lower() == "true"


A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
# Override -> (Settings field, parser). Every other key must be in IGNORED: a key the plan does not
# know fails it, so a recipe cannot change its memory behind the table's back.
MODELED = {
    "trainer.n_gpus_per_node": ("gpus_per_node", int),
    "trainer.nnodes": ("nodes", int),
    A + "strategy": ("strategy", str),
    A + "fsdp_config.param_offload": ("param_offload", _bool),
    A + "fsdp_config.optimizer_offload": ("optimizer_offload", _bool),
    A + "fsdp_config.ulysses_sequence_parallel_size": ("sequence_parallel", int),
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size": ("ref_sequence_parallel", int),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("gradient_checkpointing", _bool),
    A + "use_dynamic_bsz": ("use_dynamic_bsz", _bool),
    A + "ppo_max_token_len_per_gpu": ("ppo_tokens_per_gpu", int),
    R + "log_prob_use_dynamic_bsz": ("log_prob_dynamic_bsz", _bool),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": ("ref_log_prob_dynamic_bsz", _bool),
    R + "log_prob_max_token_len_per_gpu": ("log_prob_tokens_per_gpu", int),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": ("ref_log_prob_tokens_per_gpu", int),
    A + "entropy_coeff": ("entropy_in_update", lambda v: float(v) != 0.0),
    A + "use_kl_loss": ("use_kl_loss", _bool),
    "data.max_prompt_length": ("max_prompt", int),
    "data.max_response_length": ("max_response", int),
    R + "name": ("rollout_name", str),
    R + "tensor_model_parallel_size": ("tp", int),
    R + "gpu_memory_utilization": ("gpu_memory_utilization", float),
    R + "max_num_seqs": ("max_num_seqs", int),
    R + "max_num_batched_tokens": ("max_num_batched_tokens", int),
    R + "free_cache_engine": ("free_cache_engine", _bool),
    "+tlt.enable": ("tlt", _bool),
    "+tlt.drafter.kind": ("drafter_kind", str),
    "+tlt.drafter.trainer.tokens_per_micro": ("drafter_tokens_per_micro", int),
    "+tlt.spot.train_drafter": ("train_drafter", lambda v: v.lower() == "auto" or _bool(v)),
    "+tlt.drafter.buffer.budget_bytes": ("drafter_buffer_bytes", int),
    "+tlt.sd.bandit.arms": ("sd_max_k", lambda v: max(int(k) for k in v.strip("[]").split(","))),
}
# Keys (or prefixes ending in '.') that do not change what a GPU holds: data paths, optimizer
# hyper-parameters, batch sizes (dynamic batching bounds each micro-batch by tokens), sampling,
# logging, TLT's SD policy. The ref's param_offload: verl's ref engine is forward-only, which
# FSDP2 keeps offloaded anyway (CPUOffloadPolicy).
IGNORED = (
    "algorithm.", "trainer.total_training_steps", "trainer.save_freq", "trainer.test_freq", "trainer.logger",
    "trainer.project_name", "trainer.experiment_name", "data.train_files", "data.val_files",
    "data.train_batch_size", "data.filter_overlong_prompts", "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.use_remove_padding", A + "optim.", A + "ppo_mini_batch_size", A + "kl_loss_coef",
    R + "n", R + "temperature",
    "actor_rollout_ref.ref.fsdp_config.param_offload", "+tlt.drafter.init", "+tlt.sd.",
)


def _ignored(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in IGNORED)


@dataclass(frozen=True)
class Recipe:
    path: Path
    model: ModelShape
    card: Card
    overrides: dict[str, str]
    settings: Settings


def parse_overrides(text: str) -> dict[str, str]:
    """The `key=value` arguments of the recipe's `python -m verl.trainer.main_ppo` command, with
    `"$VAR"` replaced by the default the script gives VAR (`: "${VAR:=default}"`); a variable
    without a default (a path the caller must give) stays as written."""
    defaults = dict(re.findall(r'\$\{(\w+):=([^}]*)\}', text))
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "verl.trainer.main_ppo" in line), None)
    if start is None:
        raise ValueError("no `python -m verl.trainer.main_ppo` command")
    out: dict[str, str] = {}
    for line in lines[start + 1:]:
        arg = line.strip().removesuffix("\\").strip()
        if arg == '"$@"':
            break
        if not arg or arg.startswith("#"):
            continue
        key, sep, value = arg.partition("=")
        if not sep:
            raise ValueError(f"not a key=value override: {arg!r}")
        value = value.strip("'\"")
        var = re.fullmatch(r"\$\{?(\w+)\}?", value)
        if var and var.group(1) in defaults:
            value = defaults[var.group(1)]
        if key in out:
            raise ValueError(f"{key}: given twice")
        out[key] = value
    return out


def settings_from(overrides: dict[str, str]) -> Settings:
    values = {}
    for key, value in overrides.items():
        if key in MODELED:
            name, conv = MODELED[key]
            try:
                values[name] = conv(value)
            except ValueError as e:
                raise ValueError(f"{key}={value}: {e}") from None
        elif not _ignored(key):
            raise ValueError(f"{key}: the memory plan does not model this override (add it to "
                             "tlt_verl/launch/memory_plan.py MODELED, or to IGNORED if it holds no GPU memory)")
    s = Settings(**values)
    # verl's defaults that follow other keys (trainer/config/ref/dp_ref.yaml, rollout.yaml).
    def follow(value, actor):
        return actor if value is None else value

    return replace(s, log_prob_tokens_per_gpu=follow(s.log_prob_tokens_per_gpu, s.ppo_tokens_per_gpu),
                   ref_log_prob_tokens_per_gpu=follow(s.ref_log_prob_tokens_per_gpu, s.ppo_tokens_per_gpu),
                   log_prob_dynamic_bsz=follow(s.log_prob_dynamic_bsz, s.use_dynamic_bsz),
                   ref_log_prob_dynamic_bsz=follow(s.ref_log_prob_dynamic_bsz, s.use_dynamic_bsz))


def read_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    text = path.read_text()
    m = re.search(r"^# memory-plan: model=(\S+) card=(\S+)\s*$", text, re.M)
    if m is None:
        raise ValueError(f"{path}: no `# memory-plan: model=<name> card=<name>` line")
    if m.group(1) not in MODELS or m.group(2) not in CARDS:
        raise ValueError(f"{path}: model {m.group(1)!r} / card {m.group(2)!r}: known models "
                         f"{sorted(MODELS)}, cards {sorted(CARDS)}")
    overrides = parse_overrides(text)
    return Recipe(path, MODELS[m.group(1)], CARDS[m.group(2)], overrides, settings_from(overrides))


# ---------------------------------------------------------------------------- the drafter and estimates

@dataclass(frozen=True)
class DrafterSpec:
    """What TLT's drafter (tlt_verl/spot/, one per rank, on the rank's GPU) holds."""
    # The target's embedding and LM head: held in the rollout's dtype (the actor worker passes
    # rollout.dtype as DrafterServiceConfig.target_dtype; None here: the recipe's rollout dtype),
    # in one segment the actor's process owns and the drafter child maps (spot/shared_target.py),
    # rewritten in place at each weight sync: one pair, never a second during a swap.
    embed_head_bytes: int | None = None
    embed_head_copies: int = 1
    # The drafter's own weights are fp32 (built in the default dtype, moved with .to(device)),
    # trained under bf16 autocast with AdamW: fp32 grads and two fp32 moments.
    param_bytes: int = 4
    grad_bytes: int = 4
    adam_bytes: int = 8
    eagle3_aux: int = 3            # default_aux_layer_ids: low, middle, high
    eagle3_steps: int = 3          # LossConfig.eagle3_steps (unrolled draft steps)
    token_chunk: int = 1024        # LossConfig.token_chunk x vocab_chunk: the soft CE's logits tile
    vocab_chunk: int = 4096


def drafter_params(m: ModelShape, kind: str, aux: int = 3) -> int:
    """The drafter's own parameters (tlt_verl/drafter/eagle.py, eagle3.py): one Llama decoder layer
    of the target's widths without biases, fc, and for EAGLE-3 its norms and a full-vocabulary head."""
    h, kv, i = m.hidden, m.kv_dim, m.intermediate
    if kind == "eagle":
        # fc: cat(embed, hidden) -> H; no input layernorm.
        return 2 * h * h + (2 * h * h + 2 * h * kv) + 3 * h * i + h
    if kind == "eagle3":
        # q/k/v read cat(embed, hidden) (2H wide); input, hidden, post-attention and final norms.
        return aux * h * h + (2 * h * h + 2 * 2 * h * kv + h * h) + 3 * h * i + 4 * h + m.vocab * h
    raise ValueError(f"drafter kind {kind!r}: must be eagle or eagle3")


@dataclass(frozen=True)
class Assumptions:
    """Estimates the shapes do not decide; each is named in the table where it is used."""
    cuda_context: int = int(0.75 * GiB)      # per process on a GPU: context, cuBLAS/NCCL workspaces
    vllm_cuda_graphs: int = int(1.5 * GiB)   # vLLM's graph pool (TLT captures sizes per SD arm)
    vllm_non_torch: int = int(0.5 * GiB)     # NCCL / custom all-reduce buffers of the TP group
    min_headroom: int = 4 * GiB              # fragmentation and these estimates' error


def layer_working_set(m: ModelShape, tokens: int) -> int:
    """One decoder layer's tensors saved for backward (norm inputs, q/k/v, attention output, the
    MLP's gate/up/activation), bf16, and about as much again for their gradients."""
    return 2 * tokens * (6 * m.hidden + 2 * m.kv_dim + 3 * m.intermediate) * 2


# ---------------------------------------------------------------------------- the plan

@dataclass
class Line:
    label: str
    training: int | None        # bytes; None: not held in this phase
    rollout: int | None
    note: str = ""
    parts: list["Line"] = field(default_factory=list)


@dataclass
class Plan:
    recipe: Recipe
    lines: list[Line]
    notes: list[str]
    kv_bytes_per_token: int
    kv_tokens: int
    assumptions: Assumptions

    def total(self, phase: str) -> int:
        return sum(getattr(line, phase) or 0 for line in self.lines)

    def headroom(self, phase: str) -> int:
        return self.recipe.card.total - self.total(phase)

    @property
    def peak_phase(self) -> str:
        return max(("training", "rollout"), key=self.total)

    @property
    def fits(self) -> bool:
        return min(self.headroom("training"), self.headroom("rollout")) >= self.assumptions.min_headroom

    @property
    def errors(self) -> list[str]:
        """Settings the run would fail on regardless of the totals."""
        s, out = self.recipe.settings, []
        for what, tokens, sp in (("actor.ppo_max_token_len_per_gpu", s.ppo_tokens_per_gpu, s.sequence_parallel),
                                 ("rollout.log_prob_max_token_len_per_gpu", s.log_prob_tokens_per_gpu,
                                  s.sequence_parallel),
                                 ("ref.log_prob_max_token_len_per_gpu", s.ref_log_prob_tokens_per_gpu,
                                  s.ref_sequence_parallel)):
            # verl's rearrange_micro_batches asserts a micro-batch (tokens x SP size) holds the longest sequence.
            if tokens * sp < s.max_len:
                out.append(f"{what}={tokens} x sequence parallel {sp} < the longest sequence {s.max_len}: "
                           "verl asserts it holds one")
        if self.kv_tokens < s.max_len:
            out.append(f"vLLM's KV cache holds {self.kv_tokens} tokens, less than one {s.max_len}-token sequence")
        if not self.fits:
            out.append(f"headroom below {gib(self.assumptions.min_headroom)} GiB")
        return out


def gib(b: int | float) -> str:
    return f"{b / GiB:.2f}"


def plan(recipe: Recipe, drafter: DrafterSpec = DrafterSpec(), assume: Assumptions = Assumptions(),
         alternatives: bool = True) -> Plan:
    m, s, card = recipe.model, recipe.settings, recipe.card
    if not (s.use_dynamic_bsz and s.log_prob_dynamic_bsz and (s.ref_log_prob_dynamic_bsz or not s.use_kl_loss)):
        raise ValueError("the memory plan bounds micro-batches by tokens: it needs use_dynamic_bsz=True for the "
                         "actor and log_prob_use_dynamic_bsz=True for the rollout and ref")
    if s.rollout_name not in ("vllm", "tlt_vllm"):
        raise ValueError(f"rollout.name={s.rollout_name}: the memory plan models vLLM only")
    P, W = m.params, s.world
    lines: list[Line] = []

    # -- the actor: FSDP over every GPU of the run, fp32 master shards (fsdp_config.model_dtype
    # fp32) computed in bf16 (mixed_precision param_dtype). Outside its train/eval contexts verl
    # moves to the host what the offload flags say; it empties its cache before vLLM wakes.
    shard = f"fp32, 1/{W} shard"
    params, grads, adam = 4 * P // W, 4 * P // W, 8 * P // W
    lines.append(Line(f"actor params, {shard}", params, None if s.param_offload else params,
                      f"param_offload={s.param_offload}"))
    lines.append(Line(f"actor grads, {shard}", grads, None, "set to None when the update ends"))
    lines.append(Line(f"actor Adam moments, {shard}", adam, None if s.optimizer_offload else adam,
                      f"optimizer_offload={s.optimizer_offload}"))

    # Update: every layer's input kept (gradient checkpointing), then the largest of the LM-head
    # stage (logits and their gradient, the head gathered in bf16 with its bf16 grad and the fp32
    # copy FSDP reduce-scatters) and one layer's recompute with its gather. With Ulysses SP each
    # GPU holds its own share of the tokens (ppo_max_token_len_per_gpu).
    t = s.ppo_tokens_per_gpu
    layer, head = m.layer_params, max(m.lm_head_params, m.embed_params)
    saved = m.layers * t * m.hidden * 2 if s.gradient_checkpointing else m.layers * layer_working_set(m, t) // 2
    head_stage = 2 * t * m.vocab * 2 + (2 + 2 + 4) * head + 2 * 2 * layer
    layer_stage = layer_working_set(m, t) + (2 + 2 + 2 + 4) * layer
    if s.entropy_in_update:
        head_stage += 2 * t * m.vocab * 2
    # TLT's capture gathers the micro-batch's states (the SP group's) on the device before the copy to host.
    capture = t * s.sequence_parallel * m.hidden * 2 * (1 if s.drafter_kind == "eagle" else drafter.eagle3_aux + 1)
    capture = capture if s.tlt and s.train_drafter else 0
    passes = {"update": saved + max(head_stage, layer_stage) + capture}
    breakdown = {"update": f"layer inputs {gib(saved)} + max(LM head {gib(head_stage)}, layer {gib(layer_stage)})"
                           + (f" + capture {gib(capture)}" if capture else "")}
    # Old log-prob pass (no grad; verl computes the entropy there: logits, softmax, their product)
    # and the ref's (logits and the log-softmax); each with two units gathered in bf16.
    te, tr = s.log_prob_tokens_per_gpu, s.ref_log_prob_tokens_per_gpu
    passes["old log-prob"] = 3 * te * m.vocab * 2 + 2 * 2 * head + te * (4 * m.hidden + 3 * m.intermediate) * 2
    breakdown["old log-prob"] = f"{te} tokens: logits, softmax, product {gib(3 * te * m.vocab * 2)}"
    if s.use_kl_loss:
        passes["ref"] = 2 * tr * m.vocab * 2 + 2 * 2 * head + tr * (4 * m.hidden + 3 * m.intermediate) * 2
        breakdown["ref"] = f"{tr} tokens: logits, log-softmax {gib(2 * tr * m.vocab * 2)}"
    # The largest pass, counted next to the update's grads: an upper bound for the no-grad passes.
    which = max(passes, key=passes.get)
    lines.append(Line(f"actor activations, largest pass: {which}", passes[which], None,
                      breakdown[which] + ("" if which == "update" else
                                          f" (update: {gib(passes['update'])})")))

    # -- vLLM: its share is utilization x the card's total; inside it the weights of its TP shard
    # (and the drafter it serves, bf16), activations, CUDA graphs, NCCL, and the KV cache gets the
    # rest. Asleep (level 2) it frees weights and KV cache; graphs and NCCL buffers stay.
    share = int(s.gpu_memory_utilization * card.total)
    weights = m.params * s.rollout_dtype_bytes // s.tp
    if s.tlt:
        weights += drafter_params(m, s.drafter_kind, drafter.eagle3_aux) * s.rollout_dtype_bytes // s.tp
    vllm_acts = (s.max_num_batched_tokens * (4 * m.hidden + 3 * m.intermediate // s.tp
                                             + (m.heads + 2 * m.kv_heads) * m.head_dim // s.tp) * 2
                 # The sampler's fp32 logits and probabilities, for 1 + k positions per sequence with SD.
                 + s.max_num_seqs * (1 + (s.sd_max_k if s.tlt else 0)) * m.vocab * 4 * 2)
    fixed = assume.vllm_cuda_graphs + assume.vllm_non_torch
    kv = share - weights - vllm_acts - fixed
    kv_layers = m.layers + (1 if s.tlt else 0)            # the drafter's layer has its own KV
    kv_per_token = m.kv_bytes_per_token(s.rollout_dtype_bytes, tp=s.tp, extra_layers=kv_layers - m.layers)
    kv_tokens = max(kv, 0) // kv_per_token
    asleep = fixed if s.free_cache_engine else share
    lines.append(Line("vLLM", asleep, share,
                      f"{s.gpu_memory_utilization} x {gib(card.total)}; asleep: CUDA graphs + NCCL stay"
                      if s.free_cache_engine else "free_cache_engine=False: awake throughout", parts=[
                          Line(f"weights, bf16 1/{s.tp} TP shard" + (" + drafter" if s.tlt else ""), None, weights),
                          Line(f"KV cache: {kv_tokens:,} tokens", None, kv,
                               f"{kv_per_token:,} B/token = 2 x {kv_layers} layers x "
                               f"{max(1, m.kv_heads // s.tp)} KV heads/GPU x {m.head_dim} x bf16"),
                          Line(f"activations ({s.max_num_batched_tokens} tokens), graphs, NCCL", None,
                               vllm_acts + fixed, f"graphs {gib(assume.vllm_cuda_graphs)} + NCCL "
                               f"{gib(assume.vllm_non_torch)} assumed"),
                      ]))

    # -- TLT's drafter process: on every rank's GPU. It never empties its cache, so what its
    # training reserves in the rollout stays reserved while the actor trains.
    procs = 2
    if s.tlt:
        procs = 3
        dp = drafter_params(m, s.drafter_kind, drafter.eagle3_aux)
        # A tied target hands the drafter one tensor twice (load_target_tensors).
        eh_bytes = drafter.embed_head_bytes or s.rollout_dtype_bytes
        pair = (m.embed_params + m.lm_head_params) * eh_bytes
        target = pair * drafter.embed_head_copies
        own = dp * (drafter.param_bytes + drafter.grad_bytes + drafter.adam_bytes)
        td = s.drafter_tokens_per_micro
        steps = 1 if s.drafter_kind == "eagle" else drafter.eagle3_steps
        fc_in = (2 if s.drafter_kind == "eagle" else drafter.eagle3_aux) * m.hidden
        train = (dp * 2                                          # autocast's bf16 weight copies
                 + steps * layer_working_set(m, td)
                 + td * (fc_in + 2 * m.hidden) * 2               # the batch: inputs, targets
                 + 4 * drafter.token_chunk * drafter.vocab_chunk * 4)   # soft CE tiles
        if s.drafter_kind == "eagle3":
            train += m.vocab * m.hidden * eh_bytes      # target_head_rows() copy
        train = train if s.train_drafter else 0
        total = target + own + train
        bytes_name = {4: "fp32", 2: "bf16"}.get(eh_bytes, f"{eh_bytes} B")
        lines.append(Line(f"drafter process ({s.drafter_kind}, every rank)", total, total,
                          "reserved in both phases", parts=[
                              Line(f"target embedding + LM head, {bytes_name} x {drafter.embed_head_copies}",
                                   target, target, "one shared segment, rewritten in place at a sync"),
                              Line(f"weights + grads + AdamW, fp32 ({dp / 1e6:.0f}M params)", own, own),
                              Line(f"training, {td} tokens/micro-batch", train, train),
                          ]))

    contexts = procs * assume.cuda_context
    lines.append(Line(f"CUDA contexts, {procs} processes", contexts, contexts,
                      f"{gib(assume.cuda_context)} each assumed: actor, vLLM worker" + (", drafter" if s.tlt else "")))

    p = Plan(recipe, lines, _notes(recipe, kv_tokens), kv_per_token, kv_tokens, assume)
    if alternatives and s.tlt and s.drafter_kind == "eagle":
        # DRAFTER may name an EAGLE-3 folder, whose kind the run then takes (integration.config._resolve_kind).
        e3 = plan(replace(recipe, settings=replace(s, drafter_kind="eagle3")), drafter, assume, False)
        more = e3.total(e3.peak_phase) - p.total(p.peak_phase)
        p.notes.append(f"An EAGLE-3 drafter (DRAFTER naming one) adds {gib(more)} GiB at the peak: "
                       + ("it fits." if not e3.errors else "it does not fit; " + "; ".join(e3.errors) + "."))
    if alternatives and s.nodes > 1:
        # The actor's shards grow as the nodes shrink: say where that stops fitting.
        fits = [n for n in range(1, s.nodes + 1)
                if not plan(replace(recipe, settings=replace(s, nodes=n)), drafter, assume, False).errors]
        p.notes.append(f"With trainer.nnodes < {fits[0]} this does not fit." if fits and fits[0] > 1
                       else "It fits on fewer nodes too." if fits else f"It fits on no node count up to {s.nodes}.")
    return p


def _notes(recipe: Recipe, kv_tokens: int) -> list[str]:
    m, s = recipe.model, recipe.settings
    out = [f"KV cache: {kv_tokens // s.max_len} sequences of the longest ({s.max_len} tokens) at once; "
           f"all max_num_seqs={s.max_num_seqs} while their mean length is <= {kv_tokens // s.max_num_seqs:,}."]
    host = []
    if s.param_offload:
        host.append(f"actor params {gib(4 * m.params / s.world * s.gpus_per_node)}")
    if s.optimizer_offload:
        host.append(f"actor Adam {gib(8 * m.params / s.world * s.gpus_per_node)}")
    if s.use_kl_loss:   # verl's forward-only ref engine: fp32 shards, offloaded by FSDP2's CPUOffloadPolicy
        host.append(f"ref params {gib(4 * m.params / s.world * s.gpus_per_node)}")
    if s.tlt:
        host.append(f"drafter buffers {gib(s.drafter_buffer_bytes * s.gpus_per_node)}")
    if host:
        out.append("Host RAM per node (not in the table): " + ", ".join(host) + " GiB.")
    return out


# ---------------------------------------------------------------------------- the table

def render(p: Plan) -> list[str]:
    r, m, s = p.recipe, p.recipe.model, p.recipe.settings
    sp = f", Ulysses SP {s.sequence_parallel}" if s.sequence_parallel > 1 else ""
    head = [
        f"{BEGIN[2:]} (python -m tlt_verl.launch.memory_plan --write recipes/{r.path.name}; "
        "tests/test_recipe_memory.py checks it) >>>",
        f"Per GPU, GiB (2^30 B), on an {r.card.name}: {gib(r.card.total)} GiB as CUDA reports it "
        "(docs/memory.md: where each term comes from).",
        f"{m.name}: {m.params / 1e9:.3f}B params (embedding {m.embed_params / 1e9:.3f}B + LM head "
        f"{m.lm_head_params / 1e9:.3f}B + {m.layers} layers x {m.layer_params / 1e9:.4f}B).",
        f"{s.strategy.upper()} over {s.world} GPUs ({s.nodes} node{'s' if s.nodes > 1 else ''} x {s.gpus_per_node}"
        f"){sp}; vLLM TP {s.tp} ({s.world // s.tp} replicas), "
        + ("sleep level 2 while the actor trains." if s.free_cache_engine else "awake while the actor trains."),
        "",
        f"{'':50}{'training':>9}{'rollout':>9}",
    ]
    body = []

    def row(label: str, a: int | None, b: int | None, note: str) -> str:
        cell = lambda v: f"{'-' if v is None else gib(v):>9}"
        return f"{label:50}{cell(a)}{cell(b)}  {note}".rstrip()

    for line in p.lines:
        body.append(row(line.label, line.training, line.rollout, line.note))
        body += [row("  " + part.label, part.training, part.rollout, part.note) for part in line.parts]
    need = gib(p.assumptions.min_headroom)
    body += [
        row("total", p.total("training"), p.total("rollout"), ""),
        row("headroom", p.headroom("training"), p.headroom("rollout"), f"required >= {need}"),
        "",
        f"Peak: {p.peak_phase}, {gib(p.total(p.peak_phase))} of {gib(r.card.total)} GiB; headroom "
        f"{gib(p.headroom(p.peak_phase))} GiB (required >= {need}).",
        *p.notes,
        "Overrides appended when the recipe is run (\"$@\") are not in this table.",
    ]
    return [("# " + x).rstrip() for x in head + body] + [END]


def block_of(text: str) -> list[str] | None:
    """The recipe's current plan block (the marker lines included), or None."""
    lines = text.splitlines()
    starts = [i for i, x in enumerate(lines) if x.startswith(BEGIN)]
    ends = [i for i, x in enumerate(lines) if x == END]
    if not starts or not ends or ends[0] < starts[0]:
        return None
    return lines[starts[0]:ends[0] + 1]


def write_block(path: Path, block: list[str]) -> None:
    """Replace the block between the markers, or put it under the `# memory-plan:` line."""
    lines = path.read_text().splitlines()
    old = block_of("\n".join(lines))
    if old is not None:
        i = next(i for i, x in enumerate(lines) if x.startswith(BEGIN))
        lines[i:i + len(old)] = block
    else:
        i = next(i for i, x in enumerate(lines) if x.startswith("# memory-plan:"))
        lines[i + 1:i + 1] = block
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tlt_verl.launch.memory_plan", description=__doc__.split("\n")[0])
    ap.add_argument("recipes", nargs="+", type=Path)
    ap.add_argument("--write", action="store_true", help="rewrite the plan block in each recipe")
    args = ap.parse_args(argv)
    failed = False
    for path in args.recipes:
        p = plan(read_recipe(path))
        block = render(p)
        if args.write:
            write_block(path, block)
        print("\n".join(block))
        for e in p.errors:
            print(f"{path}: {e}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
