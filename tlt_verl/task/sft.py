"""Supervised warm-start of the tiny model on worked solutions, for a fixed number of updates.

The goal is a policy that has learned the response format, when to stop and the arithmetic,
and still has habits for GRPO to remove. The demonstrations come from a noisy teacher that
sometimes stops before the final "Answer:" line (``SFTConfig.omit_answer_prob``); the model
inherits the habit, the reward scores such responses as malformed, and GRPO unlearns it within
a few steps. From clean demonstrations the SFT model was already right 84% of the time at T=1
and the reward did not rise in 14 GRPO steps at any learning rate tried; an arithmetic slip
rate (``slip_prob``) did not help either: the reward fell (0.57 -> 0.44 at lr 1e-4).

Copying operands from the prompt is learned abruptly and late, so training length is an update
count, not wall-clock time (a time budget on a busy CPU gave too few updates). Held-out
teacher-forced accuracy (whole responses right under argmax, shown every 500 updates) jumps
between 3,000 and 3,500 updates; with clean data, 2,400 updates gave 9% exact at T=1, 3,200
about 18% and 4,000 84%. ``budget_s`` is only a safety cap.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .longtail import BODY_MAX_STEPS, Problem, generate_problems, worked_solution
from .tiny_model import TinyModelSpec, build_tiny_model, num_parameters
from .tokenizer import IM_END

IGNORE_INDEX = -100


@dataclass(frozen=True)
class SFTConfig:
    max_steps: int = 4000
    # A cap, not a target: a run that hits it logs a warning, and prepare builds it again next time
    # (its stamp records fewer updates than max_steps). Not part of the model's identity: a run that
    # is not stopped by it trains the same weights under any cap.
    budget_s: float = 900.0
    # Tuned on this task: at 3e-3 the loss stalled on a plateau and operands were never copied
    # from the prompt; 1e-3 also ended clearly worse than 7e-4.
    peak_lr: float = 7e-4
    min_lr_ratio: float = 0.05
    warmup_steps: int = 20
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    # Small batches: the number of updates matters more than batch noise here (512 tokens
    # reached a lower loss than 1,024 for the same wall-clock time).
    tokens_per_batch: int = 512
    # A noisy teacher: each worked line of a demonstration slips (result off by one, carried
    # on) with ``slip_prob``, and a demonstration stops without its final "Answer:" line with
    # ``omit_answer_prob``. The SFT model inherits both habits, which GRPO can remove: they
    # are choices the policy controls and the reward punishes, rather than knowledge a tiny
    # model lacks. From clean demonstrations, reward hardly moved in 14 GRPO steps
    # (0.92 -> 0.89, see recipes/tiny_cpu_grpo.sh).
    slip_prob: float = 0.0
    omit_answer_prob: float = 0.3
    # Fresh problems rather than epochs over the RL train split: SFT never sees the prompts RL
    # is trained on.
    num_examples: int = 24_000
    data_seed: int = 1_000_003
    model_seed: int = 0
    # Two threads: 12.4 updates/s against 7.7 for one on an idle 2-core machine. Beside another
    # busy process, two OpenMP threads fell to ~2 updates/s (one kept ~10): don't train beside
    # other jobs, or set threads=1.
    threads: int = 2
    # Where the updates run ("cpu", "cuda", "cuda:1"). Like ``threads`` it is not part of the
    # recipe: the same updates over the same batches, only the float rounding differs, so a
    # model trained on a GPU stands in for the CPU one (bench/gpu_check.py relies on it).
    device: str = "cpu"
    log_every_s: float = 10.0
    eval_every: int = 500
    eval_examples: int = 32

    def to_dict(self) -> dict:
        return asdict(self)

    def identity(self) -> dict:
        """The settings that decide the trained weights (prepare's cache key): not the thread
        count, the device, the wall-clock cap or how often progress is shown."""
        reporting = ("threads", "device", "log_every_s", "eval_every", "eval_examples", "budget_s")
        return {k: v for k, v in asdict(self).items() if k not in reporting}


def prompt_text(user_content: str) -> str:
    """The chat-templated prompt; identical to ``apply_chat_template(..., add_generation_prompt=True)``."""
    return f"<|im_start|>user\n{user_content}<|im_end|>\n<|im_start|>assistant\n"


def demonstration(problem: Problem, rng: random.Random, slip_prob: float = 0.0, omit_answer_prob: float = 0.0) -> str:
    """The worked solution as the noisy SFT teacher writes it (see SFTConfig.slip_prob)."""
    slips = {i for i in range(1, problem.num_steps + 1) if rng.random() < slip_prob}
    text = worked_solution(problem.start, problem.operands, slips)[0] if slips else problem.solution
    if rng.random() < omit_answer_prob:
        text = text.rsplit("\n", 1)[0]
    return text


def encode_examples(
    tokenizer, problems: list[Problem], slip_prob: float = 0.0, omit_answer_prob: float = 0.0, seed: int = 0
) -> list[tuple[list[int], int]]:
    """Return (input_ids, prompt_length) pairs; the response ends with <|im_end|>."""
    check = tokenizer.apply_chat_template(
        [{"role": "user", "content": problems[0].prompt}], add_generation_prompt=True, tokenize=False
    )
    if check != prompt_text(problems[0].prompt):
        raise RuntimeError("tokenizer chat template differs from the SFT prompt format")

    prompts = tokenizer([prompt_text(p.prompt) for p in problems], add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    texts = [demonstration(p, rng, slip_prob, omit_answer_prob) + IM_END for p in problems]
    responses = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [(p + r, len(p)) for p, r in zip(prompts, responses)]


def teacher_forced_accuracy(model, examples, pad_id: int) -> tuple[float, float]:
    """(token, whole-response) argmax accuracy on clean held-out examples: cheap, and it shows
    when copying operands from the prompt has been learned, long before sampling would."""
    import torch

    # Where the model's weights are (a module without any, such as a stand-in, runs on the CPU).
    device = next(model.parameters(), torch.empty(0)).device
    with torch.no_grad():
        input_ids, labels, attention = (t.to(device) for t in collate(examples, list(range(len(examples))), pad_id))
        pred = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    right = (pred == target) | ~mask
    return float(right[mask].float().mean()), float(right.all(dim=1).float().mean())


def make_batches(examples, tokens_per_batch: int, rng: random.Random) -> list[list[int]]:
    """Group examples of similar length so padding is negligible; order of batches is shuffled."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    batches, current, longest = [], [], 0
    for i in order:
        length = len(examples[i][0])
        if current and max(longest, length) * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(examples, indices: list[int], pad_id: int):
    import torch

    width = max(len(examples[i][0]) for i in indices)
    input_ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    labels = torch.full((len(indices), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(indices), width), dtype=torch.long)
    for row, i in enumerate(indices):
        ids, prompt_len = examples[i]
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
        attention[row, : len(ids)] = 1
    return input_ids, labels, attention


def progress(step: int, cfg: SFTConfig) -> float:
    """Fraction of training done, by update count (so the schedule never depends on load)."""
    return min(max(step / cfg.max_steps, 0.0), 1.0)


def lr_at(step: int, frac: float, cfg: SFTConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * frac))
    return cfg.peak_lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def train_sft(
    tokenizer,
    out_dir: str | Path,
    cfg: SFTConfig = SFTConfig(),
    spec: TinyModelSpec = TinyModelSpec(),
    log=print,
) -> dict:
    """Train the tiny model and save model, tokenizer and generation config to ``out_dir``."""
    import torch
    import torch.nn.functional as F
    from transformers import GenerationConfig

    torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"SFTConfig.device={cfg.device!r}: this torch sees no CUDA device")
    # Built on the CPU, then moved: the initial weights are the same on every device.
    model = build_tiny_model(tokenizer, spec, seed=cfg.model_seed).to(device)
    model.train()
    log(f"sft: model {num_parameters(model):,} parameters, vocab {model.config.vocab_size}, on {device}")

    t_data = time.perf_counter()
    examples = encode_examples(
        tokenizer, list(generate_problems(cfg.num_examples, cfg.data_seed)), cfg.slip_prob, cfg.omit_answer_prob,
        cfg.data_seed,
    )
    # Clean problems from the body of the length law that SFT never trains on, for the progress line.
    held_out = [p for p in generate_problems(4 * cfg.eval_examples, cfg.data_seed + 1) if p.num_steps <= BODY_MAX_STEPS]
    held_out = encode_examples(tokenizer, held_out[: cfg.eval_examples])
    rng = random.Random(cfg.data_seed)
    log(f"sft: encoded {len(examples):,} examples in {time.perf_counter() - t_data:.1f}s")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.peak_lr,
        betas=cfg.betas,
    )

    step = seen_tokens = 0
    loss_sum = loss_count = 0.0
    recent_loss = float("nan")
    epoch = 0
    start = last_log = time.perf_counter()
    done = False
    while not done:
        batches = make_batches(examples, cfg.tokens_per_batch, rng)
        for indices in batches:
            frac = progress(step, cfg)
            if frac >= 1.0 or time.perf_counter() - start > cfg.budget_s:
                done = True
                break
            lr = lr_at(step, frac, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr

            input_ids, labels, attention = (t.to(device, non_blocking=True)
                                            for t in collate(examples, indices, tokenizer.pad_token_id))
            logits = model(input_ids=input_ids, attention_mask=attention).logits
            # Shift so position t predicts token t+1; only response tokens carry a label.
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)),
                labels[:, 1:].reshape(-1),
                ignore_index=IGNORE_INDEX,
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()

            step += 1
            seen_tokens += int(attention.sum())
            if cfg.eval_every and step % cfg.eval_every == 0:
                model.eval()
                token_acc, exact = teacher_forced_accuracy(model, held_out, tokenizer.pad_token_id)
                model.train()
                log(f"sft: step {step} held-out teacher-forced accuracy: tokens {token_acc:.3f}, "
                    f"whole responses {exact:.3f}")
            loss_sum += loss.item()
            loss_count += 1
            now = time.perf_counter()
            if now - last_log >= cfg.log_every_s:
                recent_loss = loss_sum / loss_count
                log(
                    f"sft: step {step}/{cfg.max_steps} epoch {epoch} loss {recent_loss:.4f} lr {lr:.2e} "
                    f"tokens/s {seen_tokens / (now - start):,.0f} elapsed {now - start:.0f}s"
                )
                loss_sum = loss_count = 0.0
                last_log = now
        epoch += 1

    train_s = time.perf_counter() - start
    log(f"sft: finished {step} steps, {seen_tokens:,} tokens in {train_s:.0f}s")
    if step < cfg.max_steps:
        log(f"sft: warning: stopped by budget_s={cfg.budget_s:.0f} after {step} of {cfg.max_steps} updates "
            f"(busy CPU?); expect a weaker model, built again by the next ./tlt run or ./tlt prepare")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval().to("cpu")
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {
        "steps": step,
        "tokens": seen_tokens,
        "train_s": round(train_s, 1),
        "parameters": num_parameters(model),
        "final_loss": round(loss_sum / loss_count if loss_count else recent_loss, 4),
        "device": str(device),
    }
