"""The task target's warm drafter: an EAGLE-3 drafter for parallel drafting, trained offline once and
cached beside the SFT model.

TLT's default run starts RL from it and adapts it online (as the reference system starts from its
released RL drafters): a drafter from scratch accepts about one token per step for most of a short
run, so SD runs at a loss until it has learned. Trained on the target's own sampled responses to
task prompts that are not in the RL data (`tlt_verl.drafter.warmup`), for a fixed number of steps;
rebuilt only when the SFT model or these settings change, and written atomically.

EAGLE-3 with parallel drafting, not EAGLE-1: all k drafts come from one drafter forward, which on
this CPU made an SD step 1.28x faster than plain decoding at batch 1 where EAGLE-1's three draft
forwards made it 0.74x (bench/results/sd_step_cost_trained.json), and it is served the same way
by the rollout engine and `./tlt serve` (tlt_verl.rollout.config.drafter_speculative_config).
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from tlt_verl.task.prepare import _current, _hash, _read_stamp, build_stage

DIRNAME = "warm_drafter"
# Generation through vLLM (about 20 s here, where HF generate would take several minutes), then a
# fixed number of drafter steps. Steps, not seconds: on a busy machine a time budget trains a
# fraction of the steps; the time budget is only a cap. Measured on an idle 2-core box, 400 steps
# (same data, same seed): 4096 tokens per step at lr 1e-3 took 239 s for held-out top-1 agreement
# 0.831; 2048 tokens at lr 1e-3 113 s for 0.789; 2048 tokens at lr 2e-3 91 s for 0.857. The data is
# small (231 responses, 24K tokens), so half the tokens per step is still ~35 epochs, and the larger
# step makes up for the smaller batch. The drafter is far from trained at 400 steps: held-out top-1
# 0.841 / 0.863 / 0.888 / 0.915 at 400 / 500 / 600 / 800 steps (each its own schedule), and the
# chance that all three parallel drafts match the target's greedy tokens 0.48 / 0.52 / 0.56 / 0.59.
# Since the trainer stopped padding rows and building whole masks (0.74x the time per step), 560
# steps take about what 400 took, within the first run's budget.
SETTINGS = {"kind": "eagle3", "parallel_drafting": True, "max_steps": 560, "budget_s": 600.0, "num_prompts": 256,
            "max_new_tokens": 1024, "generator": "vllm", "lr": 2e-3, "tokens_per_micro": 2048}
# The keys of SETTINGS that are the drafter trainer's (the rest are WarmupConfig's).
TRAINER_KEYS = ("lr", "tokens_per_micro")


def settings_for(model_stamp: dict) -> dict:
    """The warm drafter's cache key: its settings and the SFT model build it was trained on (the
    whole stamp, not only the model's settings: a model trained again with the same settings, say
    after a capped run, has other weights)."""
    return {**SETTINGS, "target": _hash(model_stamp)}


def _complete(info: dict) -> bool:
    # A drafter the time cap stopped early is weaker: it serves the run that built it, the next
    # preparer trains it again (as prepare does for a capped SFT model).
    return info.get("steps", 0) >= SETTINGS["max_steps"]


def is_current(root: Path) -> bool:
    """Whether ``root`` (the assets folder) holds an up-to-date warm drafter for its SFT model."""
    model_stamp = _read_stamp(Path(root) / "sft_model")
    return model_stamp is not None and _current(_read_stamp(Path(root) / DIRNAME), settings_for(model_stamp), _complete)


def prepare_warm_drafter(root: Path, log=print) -> Path:
    """The exported drafter folder under ``root`` (the assets folder), built if missing or stale."""
    from tlt_verl.drafter.warmup import WarmupConfig, default_trainer, run_warmup

    root = Path(root)
    model, target = root / "sft_model", root / DIRNAME
    model_stamp = _read_stamp(model)
    if model_stamp is None:
        raise ValueError(f"{model}: no finished SFT model (run ./tlt prepare first)")
    settings = settings_for(model_stamp)

    def build(tmp: Path) -> dict:
        log(f"prepare: warm drafter: building {target} (about 2 minutes, once)")
        warmup = {k: v for k, v in SETTINGS.items() if k not in TRAINER_KEYS}
        trainer = replace(default_trainer(), **{k: SETTINGS[k] for k in TRAINER_KEYS})
        report = run_warmup(WarmupConfig(target=str(model), out=str(tmp), trainer=trainer, **warmup), log=log)
        return report.get("training", {})

    status, stamp = build_stage(target, settings, build, _complete)
    if status == "cached":
        log(f"prepare: warm drafter: up to date ({target}), built in {stamp['elapsed_s']}s earlier")
    else:
        log(f"prepare: warm drafter: built in {stamp['elapsed_s']}s")
    return target


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="build (once) the task target's warm drafter")
    parser.add_argument("--root", type=Path, required=True, help="the assets folder (holds sft_model/)")
    args = parser.parse_args(argv)
    import sys

    try:
        # Progress on stderr; stdout carries the folder, for the runner that started this.
        print(prepare_warm_drafter(args.root, log=lambda m: print(m, file=sys.stderr, flush=True)), flush=True)
    except ValueError as e:
        parser.exit(1, f"warm_drafter: {e}\n")
    # The drafter is in place (renamed atomically) and stdout flushed. Interpreter teardown would
    # only add nanobind's report of Triton's bindings (imported with vLLM's engine), some 27 lines
    # on the console of every first `./tlt run`.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
