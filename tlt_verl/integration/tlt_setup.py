"""`tlt.enable=true` at start-up: validate the `tlt:` block and turn a stock config into a TLT one.

Runs in the driver with verl's other start-up checks, before anything starts. With the switch
off (or no `tlt:` block) the config is left exactly as it is. With it on:

- `trainer.v1.trainer_mode` becomes `tlt` (the stock `sync` trainer plus the drafter hooks);
- `algorithm.rollout_correction.bypass_mode` stays as the user set it: the drafter's hidden
  states come from the actor update's forward, which every step runs;
- the initial drafter (an exported EAGLE folder, or a random one written under the run's
  checkpoint folder) is checked against the target and handed to the rollout servers
  (`actor_rollout_ref.rollout.custom.tlt_sd`) with the SD policy settings.
"""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from omegaconf import OmegaConf, open_dict

from tlt_verl.integration.config import (SCRATCH, SUPPORTED_ROLLOUTS, SUPPORTED_TRAINER_MODES, TLTConfig,
                                         TLTConfigError)
from tlt_verl.integration.startup_checks import ConfigError, on_cpu, register_check


def initial_drafter_dir(config) -> Path:
    return Path(config.trainer.default_local_dir) / "tlt" / "drafter_init"


def write_scratch_drafter(target_dir: str, kind: str, out: Path, seed: int = 0) -> Path:
    """A random drafter bound to the target's embedding and LM head, in vLLM's layout."""
    import torch
    from transformers import AutoConfig

    from tlt_verl.drafter import DrafterConfig, build_drafter
    from tlt_verl.drafter.export import export_drafter
    from tlt_verl.drafter.target_weights import load_target_tensors

    target_config = AutoConfig.from_pretrained(target_dir)
    try:
        embed, head = load_target_tensors(target_dir, bool(getattr(target_config, "tie_word_embeddings", False)))
    except ValueError as e:
        raise ConfigError(f"actor_rollout_ref.model.path: {e} (TLT needs an HF Llama/Qwen2 checkpoint)") from None
    torch.manual_seed(seed)
    return export_drafter(build_drafter(DrafterConfig.from_target(target_config, kind=kind), embed, head), out)


@register_check
def check_tlt(config) -> None:
    block = OmegaConf.select(config, "tlt")
    if block is None:
        return
    try:
        tlt = TLTConfig.from_dict(OmegaConf.to_container(block, resolve=True))
    except TLTConfigError as e:
        raise ConfigError(str(e)) from None
    if not tlt.enable:
        return
    rollout = OmegaConf.select(config, "actor_rollout_ref.rollout.name")
    if rollout not in SUPPORTED_ROLLOUTS:
        raise ConfigError(f"tlt.enable=true: actor_rollout_ref.rollout.name={rollout} is not supported by TLT "
                          f"(supported: {', '.join(SUPPORTED_ROLLOUTS)})")
    if rollout == "vllm" and not on_cpu():
        # On CPU the plugin serves rollout.name=vllm with tlt_vllm; on GPU it is verl's own server,
        # which runs neither the drafter push nor the SD policy.
        raise ConfigError("tlt.enable=true: actor_rollout_ref.rollout.name=vllm on GPU is verl's own vLLM server; "
                          "use actor_rollout_ref.rollout.name=tlt_vllm")
    from tlt_verl.patches import vllm_sd

    problem = vllm_sd.version_problem()
    if problem is not None:
        raise ConfigError(f"tlt.enable=true: {problem}; TLT drives vLLM through them")
    if not OmegaConf.select(config, "trainer.use_v1", default=True):
        raise ConfigError("tlt.enable=true: trainer.use_v1=False is not supported (TLT extends the V1 trainer)")
    mode = OmegaConf.select(config, "trainer.v1.trainer_mode")
    if mode not in SUPPORTED_TRAINER_MODES + ("tlt",):
        raise ConfigError(f"tlt.enable=true: trainer.v1.trainer_mode={mode} is not supported "
                          f"(supported: {', '.join(SUPPORTED_TRAINER_MODES)})")
    custom = OmegaConf.select(config, "actor_rollout_ref.rollout.custom") or {}
    if "tlt_sd" in custom:
        raise ConfigError("tlt.enable=true: actor_rollout_ref.rollout.custom.tlt_sd is set by TLT; remove it")

    _check_shared_paths(config, tlt)
    target = str(OmegaConf.select(config, "actor_rollout_ref.model.path"))
    d = tlt.drafter
    # Absolute: the rollout servers are Ray actors whose working directory is not the driver's.
    folder = (initial_drafter_dir(config) if d.init == SCRATCH else Path(d.init)).absolute()
    if d.init == SCRATCH and not (folder / "model.safetensors").is_file():
        write_scratch_drafter(os.path.expanduser(target), d.kind, folder)
    _check_drafter_fits(folder, target, d.kind)

    with open_dict(config):
        config.trainer.v1.trainer_mode = "tlt"
        tlt_sd = {"drafter": str(folder), "method": d.kind, "policy": _policy_dict(tlt)}
        OmegaConf.update(config, "actor_rollout_ref.rollout.custom", {**dict(custom), "tlt_sd": tlt_sd}, merge=False)


def _check_shared_paths(config, tlt: TLTConfig) -> None:
    """On several nodes, the folders that servers and ranks on other nodes read must be one shared path."""
    nnodes = int(OmegaConf.select(config, "trainer.nnodes", default=1) or 1)
    if nnodes <= 1:
        return
    folders = {"trainer.default_local_dir": OmegaConf.select(config, "trainer.default_local_dir")}
    if tlt.drafter.init != SCRATCH:
        folders["tlt.drafter.init"] = tlt.drafter.init
    for option, value in folders.items():
        if value is not None and not os.path.isabs(os.path.expanduser(str(value))):
            raise ConfigError(f"tlt.enable=true: {option}={value}: trainer.nnodes={nnodes} needs an absolute path "
                              f"on storage every node shares (the drafter is read from it on every node)")


def _policy_dict(tlt: TLTConfig) -> dict:
    p = asdict(tlt.sd)
    p["bandit"] = {k: list(v) if isinstance(v, tuple) else v for k, v in p["bandit"].items()}
    return p


def _check_drafter_fits(folder: Path, target: str, kind: str) -> None:
    from transformers import AutoConfig

    from tlt_verl.drafter.export import read_drafter_config

    try:
        got = read_drafter_config(folder, AutoConfig.from_pretrained(os.path.expanduser(target)))
    except ValueError as e:
        raise ConfigError(f"tlt.drafter.init: {e}") from None
    if got.kind != kind:
        raise ConfigError(f"tlt.drafter.init={folder}: is an {got.kind} drafter, but tlt.drafter.kind={kind}")
