"""Serving a run's export: vLLM's OpenAI server with the drafter against the same policy without it.

    ./tlt run --steps 2 --run-dir RUN && .venv/bin/python bench/serve.py --run-dir RUN

starts `./tlt serve RUN` and `./tlt serve RUN --no-drafter` side by side (child processes on free
ports, stopped by pid at the end), sends the same task chat requests over HTTP at T=0 to each, one
at a time (batch 1), in alternating order over several rounds, and writes
`bench/results/serve.json`: `identical_fraction` (answers equal token for token), `batch1_speedup`
(median over rounds of completion tokens per second of request time, drafter / no drafter; its
spread and each round's raw timings alongside), the engine-side decode speed-up (vLLM's own
per-request decode time) and the drafter's acceptance length from vLLM's counters.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import portable_settings  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, help="a run folder with exports (./tlt run --run-dir)")
    ap.add_argument("--out", default=str(REPO / "bench/results/serve.json"))
    ap.add_argument("--prompts", type=int, default=6, help="chat requests per server per round")
    ap.add_argument("--rounds", type=int, default=6, help="rounds, alternating which server goes first")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=2024, help="task problems (not the RL data's seeds)")
    ap.add_argument("--k", type=int, default=None, help="speculative tokens (default: the export's)")
    ap.add_argument("--vllm-args", default="", help="extra `vllm serve` arguments for both servers, one string")
    ap.add_argument("--logs", default=None, help="server logs folder (default: a new temporary folder)")
    args = ap.parse_args(argv)

    from tlt_verl.serve.client import compare, servers, task_messages
    from tlt_verl.serve.export import latest_export

    export = latest_export(args.run_dir, hashes=True)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="tlt-serve-bench-")).resolve()
    print(f"server logs: {logs}", flush=True)
    t0 = time.time()
    import shlex

    sd_options = ("--k", str(args.k)) if args.k else ()
    with servers(Path(args.run_dir), logs, sd_options=sd_options, extra=tuple(shlex.split(args.vllm_args))) as started:
        ready_s = time.time() - t0
        result = compare({name: s.url for name, s in started.items()},
                         task_messages(args.prompts, args.seed), rounds=args.rounds, max_tokens=args.max_tokens)
    m = export.manifest
    result = {"identical_fraction": result.pop("identical_fraction"), "batch1_speedup": result.pop("batch1_speedup"),
              **result,
              "export": {"step": m["step"], "drafter": m.get("drafter") and {k: m["drafter"][k] for k in ("kind", "state_version")},
                         "acceptance_in_run": m.get("acceptance"), "serve": m.get("serve")},
              "servers_ready_s": ready_s, "wall_s": time.time() - t0,
              "settings": portable_settings({**vars(args), "logs": None})}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    s = result["batch1_speedup_spread"]
    print(f"identical {result['identical_fraction']:.0%} | batch-1 speed-up {result['batch1_speedup']:.2f}x "
          f"(rounds {s['min']:.2f}-{s['max']:.2f}) | engine decode {result['engine_decode_speedup']['median']:.2f}x "
          f"| acceptance {result['acceptance_length']:.2f} -> {out}")


if __name__ == "__main__":
    main()
