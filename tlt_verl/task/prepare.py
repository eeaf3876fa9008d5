"""Build (or reuse) every artifact the long-tail GRPO run needs: tokenizer, parquet data, SFT model.

Each stage writes into a temporary directory and renames it into place, with a stamp file holding
the hash of the settings that produced it. A stage is skipped when its stamp matches, so repeated
runs are cheap and an interrupted run never leaves a half-written artifact that looks complete.

    python -m tlt_verl.task.prepare --root DIR [--force] [--eval 64] [--device cuda]
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from . import longtail, tokenizer as tokenizer_mod
from .longtail import generate_problems, write_parquet
from .sft import SFTConfig, prompt_text, train_sft
from .tiny_model import TinyModelSpec
from tlt_verl.utils.files import build_dir_atomically

# Bump when the meaning of an artifact changes in a way the settings below do not capture.
FORMAT_VERSION = 1
STAMP_NAME = ".prepare_stamp.json"

TRAIN_SEED = 1
VAL_SEED = 2


@dataclass(frozen=True)
class PrepareSettings:
    n_train: int = 2048
    n_val: int = 128
    # Rows of the train split come in batches of this many prompts with the same length mix
    # (longtail.stratified_order); it must equal the recipe's data.train_batch_size.
    train_batch_size: int = 16
    train_seed: int = TRAIN_SEED
    val_seed: int = VAL_SEED
    sft: SFTConfig = field(default_factory=SFTConfig)
    model: TinyModelSpec = field(default_factory=TinyModelSpec)


# SFT wall-clock cap per decoder layer for deeper models: an update costs about a layer's worth
# more per layer (4.3 updates/s at 16 layers against 16/s at 4 on this 2-core box).
SFT_BUDGET_S_PER_LAYER = 150.0


def settings_for_layers(layers: int | None, settings: PrepareSettings | None = None) -> PrepareSettings:
    """The same task and SFT recipe with a ``layers``-deep model (None: the default depth).

    Deeper targets serve the rollout benchmark: at 4 layers a decode step on CPU is mostly
    per-op overhead, so the target costs only about 4x one drafter layer, far from the 28-80 to
    1 of the models TLT is meant for."""
    settings = settings or PrepareSettings()
    if layers is None or layers == settings.model.num_hidden_layers:
        return settings
    if layers < 1:
        raise ValueError(f"layers={layers}: must be >= 1")
    budget = max(settings.sft.budget_s, SFT_BUDGET_S_PER_LAYER * layers)
    return replace(settings, model=replace(settings.model, num_hidden_layers=layers),
                   sft=replace(settings.sft, budget_s=budget))


def assets_dirname(layers: int | None) -> str:
    """Where under the cache home the assets for a ``layers``-deep model live."""
    default = TinyModelSpec().num_hidden_layers
    return "assets" if layers in (None, default) else f"assets_L{layers}"


def _generator_settings() -> dict:
    return {
        "min_steps": longtail.MIN_STEPS,
        "max_steps": longtail.MAX_STEPS,
        "shift": longtail.STEP_SHIFT,
        "alpha": longtail.STEP_ALPHA,
        "body_max": longtail.BODY_MAX_STEPS,
        "tail": [longtail.TAIL_MIN_STEPS, longtail.TAIL_PROB],
        "values": [longtail.MIN_VALUE, longtail.MAX_VALUE],
        "max_operand": longtail.MAX_OPERAND,
        "prompt": [longtail.PROMPT_HEADER, longtail.PROMPT_FOOTER, longtail.ANSWER_PREFIX],
    }


def _stage_settings(settings: PrepareSettings) -> dict[str, dict]:
    tok = {
        "format": FORMAT_VERSION,
        "generator": _generator_settings(),
        "corpus": [tokenizer_mod.TRAIN_PROBLEMS, tokenizer_mod.TRAIN_SEED],
        "vocab": tokenizer_mod.TARGET_VOCAB_SIZE,
        "regex": tokenizer_mod.QWEN2_SPLIT_REGEX,
        "template": tokenizer_mod.CHAT_TEMPLATE,
    }
    data = {
        "format": FORMAT_VERSION,
        "generator": _generator_settings(),
        "train": [settings.n_train, settings.train_seed, settings.train_batch_size],
        "val": [settings.n_val, settings.val_seed],
    }
    # The model depends on the tokenizer, so its hash covers the tokenizer's settings too.
    model = {"format": FORMAT_VERSION, "tokenizer": tok, "sft": settings.sft.identity(), "model": settings.model.to_dict()}
    return {"tokenizer": tok, "data": data, "model": model}


def _hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read_stamp(directory: Path) -> dict | None:
    try:
        return json.loads((directory / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def _build_atomically(target: Path, build: Callable[[Path], dict], settings: dict) -> dict:
    """Run ``build(tmp_dir)`` and move the finished directory to ``target`` in one rename."""
    def build_stamped(tmp: Path) -> dict:
        start = time.perf_counter()
        info = build(tmp) or {}
        stamp = {"hash": _hash(settings), "elapsed_s": round(time.perf_counter() - start, 1), "info": info,
                 "settings": settings}
        # The stamp is written last: its presence is what marks the directory as complete.
        (tmp / STAMP_NAME).write_text(json.dumps(stamp, indent=2, default=str))
        return stamp

    return build_dir_atomically(target, build_stamped)


@contextmanager
def _one_builder(target: Path):
    """Held while an artifact is checked and, if stale, built: of several processes preparing the
    same folder (two runs started together, a test run beside a user's run) one builds and the
    others wait, then find it up to date, rather than each training its own copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # The lock is on the folder that holds the artifacts, so that no lock file is left beside them.
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _current(stamp: dict | None, settings: dict, complete: Callable[[dict], bool]) -> bool:
    return stamp is not None and stamp.get("hash") == _hash(settings) and complete(stamp.get("info") or {})


def build_stage(target: Path, settings: dict, build: Callable[[Path], dict],
                complete: Callable[[dict], bool] = lambda info: True) -> tuple[str, dict]:
    """``target`` as ``settings`` make it: ("cached", its stamp) when its stamp matches and
    ``complete(its info)`` holds, else ("built", the new stamp) after ``build(tmp_dir)`` and one
    rename. An artifact that is usable but short of its settings (an SFT run stopped by its
    wall-clock cap on a busy machine) serves the run that built it and is built again next time."""
    with _one_builder(target):
        stamp = _read_stamp(target)
        if _current(stamp, settings, complete):
            return "cached", stamp
        return "built", _build_atomically(target, build, settings)


def _completeness(settings: PrepareSettings) -> dict[str, Callable[[dict], bool]]:
    """Per stage, whether a built artifact is all its settings ask for. The SFT model must have
    had all its updates: one the wall-clock cap stopped early is weaker (at 2,715 of 4,000 updates
    16% of well-formed answers were right against the 30-97% the tests expect)."""
    steps = settings.sft.max_steps
    return {"model": lambda info: info.get("steps", steps) >= steps}


STAGE_DIRS = {"tokenizer": "tokenizer", "data": "data", "model": "sft_model"}


def stale_stages(root: Path, settings: PrepareSettings | None = None) -> list[str]:
    """The stages ``prepare(root, settings=settings)`` would build rather than reuse: a caller
    that cannot afford a build (an SFT run takes minutes) asks first."""
    settings = settings or PrepareSettings()
    stages, complete = _stage_settings(settings), _completeness(settings)
    return [name for name, sub in STAGE_DIRS.items()
            if not _current(_read_stamp(Path(root) / sub), stages[name], complete.get(name, lambda info: True))]


def prepare(root: Path, force: bool = False, settings: PrepareSettings | None = None, log=print) -> dict:
    """Build tokenizer, train/val parquet and SFT model under ``root``; return their paths.

    Returned keys: root, tokenizer, data, train, val, model, and ``report`` (per-stage status,
    elapsed seconds and stage info).
    """
    from transformers import AutoTokenizer

    root = Path(root)
    settings = settings or PrepareSettings()
    stages = _stage_settings(settings)
    paths = {
        "root": root,
        "tokenizer": root / STAGE_DIRS["tokenizer"],
        "data": root / STAGE_DIRS["data"],
        "train": root / STAGE_DIRS["data"] / "train.parquet",
        "val": root / STAGE_DIRS["data"] / "val.parquet",
        "model": root / STAGE_DIRS["model"],
    }
    report: dict[str, dict] = {}

    def run_stage(name: str, target: Path, build: Callable[[Path], dict],
                  complete: Callable[[dict], bool] = lambda info: True) -> None:
        if force:
            with _one_builder(target):
                status, stamp = "built", _build_atomically(target, logged(name, target, build), stages[name])
        else:
            status, stamp = build_stage(target, stages[name], logged(name, target, build), complete)
        report[name] = {"status": status, "elapsed_s": stamp["elapsed_s"], "info": stamp.get("info", {})}
        if status == "cached":
            log(f"prepare: {name}: up to date ({target}), built in {stamp['elapsed_s']}s earlier")
        else:
            log(f"prepare: {name}: built in {stamp['elapsed_s']}s")

    def logged(name: str, target: Path, build: Callable[[Path], dict]) -> Callable[[Path], dict]:
        def run(tmp: Path) -> dict:
            log(f"prepare: {name}: building {target}")
            return build(tmp)
        return run

    def build_tokenizer(tmp: Path) -> dict:
        tok = tokenizer_mod.build_tokenizer(tmp)
        return {"vocab": len(tok), "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}

    run_stage("tokenizer", paths["tokenizer"], build_tokenizer)
    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])

    def build_data(tmp: Path) -> dict:
        write_parquet(tmp / "train.parquet", settings.n_train, settings.train_seed, "train",
                      batch_size=settings.train_batch_size)
        write_parquet(tmp / "val.parquet", settings.n_val, settings.val_seed, "test")
        for split in ("train", "val"):
            longtail.read_rows(tmp / f"{split}.parquet")
        return {
            "train": token_length_stats(tok, settings.n_train, settings.train_seed),
            "val": token_length_stats(tok, settings.n_val, settings.val_seed),
        }

    run_stage("data", paths["data"], build_data)

    def build_model(tmp: Path) -> dict:
        return train_sft(tok, tmp, settings.sft, settings.model, log=log)

    run_stage("model", paths["model"], build_model, complete=_completeness(settings)["model"])
    paths["report"] = report
    return paths


def _percentiles(values: list[int]) -> dict:
    ordered = sorted(values)

    def pct(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": pct(0.5), "p90": pct(0.9), "max": ordered[-1], "mean": round(sum(ordered) / len(ordered), 1)}


def token_length_stats(tok, n: int, seed: int) -> dict:
    """Token lengths of the chat-templated prompts and the reference responses (incl. <|im_end|>)."""
    problems = list(generate_problems(n, seed))
    prompts = tok([prompt_text(p.prompt) for p in problems], add_special_tokens=False)["input_ids"]
    responses = tok([p.solution + tokenizer_mod.IM_END for p in problems], add_special_tokens=False)["input_ids"]
    return {
        "prompt": _percentiles([len(x) for x in prompts]),
        "response": _percentiles([len(x) for x in responses]),
        "num_steps": _percentiles([p.num_steps for p in problems]),
    }


def evaluate(
    model_dir: str | Path,
    n: int = 64,
    seed: int = VAL_SEED,
    temperature: float = 0.0,
    max_new_tokens: int = 1024,
    batch_size: int = 64,
) -> dict:
    """Quick accuracy/length report with plain HF ``generate`` (reporting only; not the rollout path).

    With the default seed the problems are the first ``n`` rows of the val split.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from .reward import compute_score

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **sampling,
    )
    torch.manual_seed(seed)

    problems = list(generate_problems(n, seed))
    # Similar prompt lengths per batch: less padding, and long problems don't slow the short ones.
    order = sorted(range(n), key=lambda i: problems[i].num_steps)
    records = [None] * n
    start = time.perf_counter()
    for b in range(0, n, batch_size):
        idx = order[b : b + batch_size]
        enc = tok([prompt_text(problems[i].prompt) for i in idx], add_special_tokens=False, padding=True,
                  return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, generation_config=gen_cfg)
        new = out[:, enc["input_ids"].shape[1]:].tolist()
        for i, ids in zip(idx, new):
            stopped = tok.eos_token_id in ids
            ids = ids[: ids.index(tok.eos_token_id) + 1] if stopped else ids
            text = tok.decode(ids, skip_special_tokens=True)
            score = compute_score(longtail.DATA_SOURCE, text, str(problems[i].answer))
            lines = text.strip().split("\n")
            records[i] = {
                "len": len(ids),
                "stopped": stopped,
                "acc": score["acc"],
                "format_ok": score["format_ok"],
                "steps_ok": len(lines) == problems[i].num_steps + 1,
                "num_steps": problems[i].num_steps,
            }

    def mean(key, subset=None):
        rows = [r for r in records if subset is None or subset(r)]
        return round(sum(float(r[key]) for r in rows) / len(rows), 3) if rows else None

    return {
        "n": n,
        "temperature": temperature,
        "acc": mean("acc"),
        "acc_short(<=3 steps)": mean("acc", lambda r: r["num_steps"] <= 3),
        "acc_mid(4-15)": mean("acc", lambda r: 4 <= r["num_steps"] < 16),
        "acc_long(>=16)": mean("acc", lambda r: r["num_steps"] >= 16),
        "format_ok": mean("format_ok"),
        "stopped": mean("stopped"),
        "step_count_ok": mean("steps_ok"),
        "response_len": _percentiles([r["len"] for r in records]),
        "generate_s": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="directory for all artifacts")
    parser.add_argument("--force", action="store_true", help="rebuild every stage even if up to date")
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT updates (default: SFTConfig.max_steps)")
    parser.add_argument("--device", default="cpu",
                        help="where the SFT updates run, e.g. cuda (default cpu; not part of the cache key)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers of the SFT model (default: TinyModelSpec.num_hidden_layers)")
    parser.add_argument("--eval", type=int, default=0, metavar="N",
                        help="after preparing, evaluate the SFT model on N val prompts at T=1 and T=0")
    args = parser.parse_args(argv)

    settings = PrepareSettings()
    if args.sft_steps is not None:
        settings = replace(settings, sft=replace(settings.sft, max_steps=args.sft_steps))
    settings = replace(settings, sft=replace(settings.sft, device=args.device))
    try:
        settings = settings_for_layers(args.layers, settings)
    except ValueError as e:
        parser.error(f"--{e}")

    start = time.perf_counter()
    paths = prepare(args.root, force=args.force, settings=settings)
    print(f"prepare: done in {time.perf_counter() - start:.1f}s")
    for name, stage in paths["report"].items():
        print(f"  {name}: {stage['status']} ({stage['elapsed_s']}s) {json.dumps(stage['info'])}")
    for key in ("tokenizer", "train", "val", "model"):
        print(f"  {key}: {paths[key]}")
    if args.eval:
        for temperature in (1.0, 0.0):
            print(f"  eval T={temperature}: {json.dumps(evaluate(paths['model'], n=args.eval, temperature=temperature))}")


if __name__ == "__main__":
    main()
