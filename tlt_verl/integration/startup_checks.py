"""Start-up checks on the Hydra config, run in the driver before verl's own validation.

A user's mistake must stop the run with one line that names the option or file, not with a
traceback from a Ray worker minutes later. Checks are registered functions; each either
passes, fills a default that only one value can have, or raises ConfigError.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from tlt_verl.patches import require_attr, when_imported


class ConfigError(ValueError):
    """Bad user input; the message is one line naming the option or file."""


Check = Callable[[DictConfig], None]
CHECKS: list[Check] = []


def register_check(fn: Check) -> Check:
    CHECKS.append(fn)
    return fn


def run_checks(config: DictConfig) -> None:
    for check in CHECKS:
        check(config)


def install() -> None:
    when_imported("verl.utils.config", _wrap_validate_config)


def _wrap_validate_config(mod) -> None:
    original = require_attr(mod, "validate_config", "tlt-verl start-up checks")
    if getattr(original, "_tlt_wrapped", False):
        return

    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        try:
            run_checks(config)
        except ConfigError as e:
            # SystemExit passes through Hydra's error report: the user sees one line.
            raise SystemExit(f"tlt-verl: {e}") from None
        return original(config, *args, **kwargs)

    validate_config._tlt_wrapped = True
    mod.validate_config = validate_config


def on_cpu() -> bool:
    return os.environ.get("VERL_PLATFORM", "").lower() == "cpu"


def _select(config, key, default=None):
    return OmegaConf.select(config, key, default=default)


def _files(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple, ListConfig)):
        return [str(v) for v in value]
    return [str(value)]


# ---- user input ------------------------------------------------------------------------------


@register_check
def check_model_path(config: DictConfig) -> None:
    path = _select(config, "actor_rollout_ref.model.path")
    if path is None:
        raise ConfigError("actor_rollout_ref.model.path is not set")
    local = os.path.expanduser(str(path))
    # A hub id is exactly "org/name"; anything else is a local path. Nothing is downloaded on CPU.
    looks_local = str(path).startswith(("/", ".", "~")) or str(path).count("/") != 1
    if (looks_local or on_cpu() or os.environ.get("HF_HUB_OFFLINE") == "1") and not os.path.isdir(local):
        raise ConfigError(f"actor_rollout_ref.model.path={path}: no such model directory")
    if os.path.isdir(local) and not os.path.exists(os.path.join(local, "config.json")):
        raise ConfigError(f"actor_rollout_ref.model.path={path}: no config.json in that directory")


@register_check
def check_datasets(config: DictConfig) -> None:
    from tlt_verl.integration.dataset_check import check_rl_parquet

    prompt_key = _select(config, "data.prompt_key", "prompt")
    for option in ("data.train_files", "data.val_files"):
        for f in _files(_select(config, option)):
            if not os.path.exists(f):
                raise ConfigError(f"{option}: no such file {f}")
            problem = check_rl_parquet(f, prompt_key)
            if problem:
                raise ConfigError(f"{option}: {problem}")


def _user_overrides() -> set[str]:
    """Keys the user set on the command line (Hydra), without +/++/~ prefixes."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = HydraConfig.get().overrides.task
    except Exception:  # not under Hydra: everything counts as chosen by the caller
        return set(GPU_ONLY)
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


# ---- CPU platform ----------------------------------------------------------------------------

# Options that need a GPU, with what to use instead on CPU.
GPU_ONLY = {
    "actor_rollout_ref.actor.strategy": ({"fsdp", "megatron"}, "fsdp2"),
    "actor_rollout_ref.ref.strategy": ({"fsdp", "megatron"}, "fsdp2"),
    "critic.strategy": ({"fsdp", "megatron"}, "fsdp2"),
    "actor_rollout_ref.model.override_config.attn_implementation": ({"flash_attention_2", "flash_attention_3"}, "sdpa"),
    "actor_rollout_ref.rollout.name": ({"sglang", "trtllm"}, "vllm"),
}


@register_check
def check_cpu_options(config: DictConfig) -> None:
    if not on_cpu():
        return
    explicit = _user_overrides()
    with open_dict(config):
        for key, (gpu_only, instead) in GPU_ONLY.items():
            value = _select(config, key)
            if value not in gpu_only:
                continue
            if key in explicit:
                raise ConfigError(f"{key}={value} needs a GPU; on CPU use {key}={instead}")
            # verl's GPU default, not the user's choice: the CPU equivalent computes the same.
            OmegaConf.update(config, key, instead, merge=False)
        # verl defaults attention to flash_attention_2, which CPU torch lacks.
        if _select(config, "actor_rollout_ref.model.override_config.attn_implementation") is None:
            config.actor_rollout_ref.model.override_config["attn_implementation"] = "sdpa"
        # verl sizes resource pools in Ray GPUs: on CPU they are logical slots, one per rank
        # (on a cluster started by docker/launch.sh, each node declares its own).
        ray_init = config.ray_kwargs.ray_init
        if ray_init.get("num_gpus") is None and not joins_cluster(config):
            ray_init["num_gpus"] = config.trainer.n_gpus_per_node * config.trainer.nnodes


def joins_cluster(config: DictConfig) -> bool:
    """Whether verl's ray.init connects to a running cluster (ray_init.address or RAY_ADDRESS)."""
    return bool(_select(config, "ray_kwargs.ray_init.address") or os.environ.get("RAY_ADDRESS"))


@register_check
def check_cluster_resources(config: DictConfig) -> None:
    # ray.init refuses num_cpus / num_gpus when it connects to a running cluster: there the
    # nodes declared their resources when they started. A recipe's local-run sizing is dropped.
    if not joins_cluster(config):
        return
    ray_init = config.ray_kwargs.ray_init
    with open_dict(config):
        for key in ("num_cpus", "num_gpus"):
            if ray_init.get(key) is not None:
                ray_init[key] = None
