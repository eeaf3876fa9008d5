"""The `verl.plugins` entry point: verl imports this in every process, Ray workers included.

It picks the CPU platform on a CPU-only torch build, registers the tlt_vllm rollout backend,
installs the start-up checks, and arms hidden-state capture in the actor's update (inert
until a drafter worker enables it in its process). verl swallows exceptions raised by plugins,
so a patch that does not fit the installed versions stops the process here with its one-line
reason.
"""
from __future__ import annotations

import os

import torch

from tlt_verl.patches import PatchError


def cpu_only_build() -> bool:
    """True when this torch cannot drive any accelerator verl knows."""
    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        return False
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return True
    return False


def _load() -> None:
    platform = os.environ.get("VERL_PLATFORM", "").strip().lower()
    on_cpu = platform == "cpu" or (not platform and cpu_only_build())
    if on_cpu:
        from tlt_verl.patches import verl_cpu

        verl_cpu.apply()

    from tlt_verl.patches import verl_capture

    verl_capture.apply()

    from tlt_verl.integration import rollout_registry, startup_checks, tlt_setup  # noqa: F401 (registers its check)
    from tlt_verl.patches import when_imported

    rollout_registry.register(on_cpu=on_cpu)
    startup_checks.install()
    # The TLT trainer mode, registered wherever verl looks trainers up (the TaskRunner actor).
    when_imported("verl.trainer.ppo.v1", _register_tlt_trainer)


def _register_tlt_trainer(_module) -> None:
    from tlt_verl.integration import tlt_trainer  # noqa: F401 (@register_trainer)


try:
    _load()
except PatchError as e:
    raise SystemExit(f"tlt-verl: {e}") from None
