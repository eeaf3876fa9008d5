"""`tlt-verl` (also `./tlt`): run the embedded default, prepare assets, benchmark."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _run(args) -> int:
    from tlt_verl.launch.runner import RunConfig, RunError, run

    cfg = RunConfig(recipe=args.recipe, steps=args.steps, overrides=args.overrides,
                    run_dir=Path(args.run_dir) if args.run_dir else None)
    try:
        run(cfg)
    except RunError as e:
        print(f"tlt-verl: {e}", file=sys.stderr)
        return 1
    return 0


def _prepare(args) -> int:
    from tlt_verl.launch.runner import DEFAULT_HOME
    from tlt_verl.task.prepare import prepare

    prepare(Path(args.root or DEFAULT_HOME / "assets"), force=args.force)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # The harness lives in bench/ (it is not part of the installed package).
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from bench.run_recipe import main as bench_main

        return bench_main(argv[1:])
    p = argparse.ArgumentParser(prog="tlt-verl")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a recipe (default: the tiny CPU GRPO run)")
    r.add_argument("--recipe", default="tiny_cpu_grpo", help="recipe name in recipes/ or a path")
    r.add_argument("--steps", type=int, default=14)
    r.add_argument("--run-dir", default=None)
    r.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. actor_rollout_ref.actor.optim.lr=1e-5")
    r.set_defaults(fn=_run)
    sub.add_parser("bench", help="run a recipe and write its rollout benchmark (JSON + PNG); see `bench --help`")
    pr = sub.add_parser("prepare", help="build the tokenizer, task data and SFT model (cached)")
    pr.add_argument("--root", default=None)
    pr.add_argument("--force", action="store_true")
    pr.set_defaults(fn=_prepare)
    args = p.parse_args(argv)
    if getattr(args, "steps", 1) < 1:
        p.error("--steps must be >= 1")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
