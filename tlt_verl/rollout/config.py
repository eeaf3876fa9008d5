"""Configuration of the adaptive rollout: which drafter the engine serves and how SD is chosen.

It reaches the rollout server through verl's own extension slot, `actor_rollout_ref.rollout.custom`
(`RolloutConfig.custom`, a free dict), under the key `tlt_sd`:

    actor_rollout_ref.rollout.custom='{tlt_sd: {drafter: /path/to/drafter, method: eagle}}'

Without that key the server is plain vLLM. Everything is checked when the server starts, and a
bad value stops it with one line naming the option.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from tlt_verl.rollout.lossless import check_speculative_config
from tlt_verl.rollout.policy.sd_policy import SDPolicyConfig

logger = logging.getLogger(__name__)

KEY = "tlt_sd"
OPTION = f"actor_rollout_ref.rollout.custom.{KEY}"
# vLLM's speculative method for each drafter layout tlt_verl.drafter.export writes.
METHODS = {"eagle": "eagle", "eagle3": "eagle3"}


@dataclass(frozen=True)
class AdaptiveRolloutConfig:
    drafter: str                                   # exported drafter folder (vLLM layout)
    method: str = "eagle"
    policy: SDPolicyConfig = field(default_factory=SDPolicyConfig)
    poll_interval_s: float = 0.02
    # GPU only: CUDA graphs captured per strategy just for the batch sizes it can run at.
    cuda_graph_pool: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.policy, Mapping):
            object.__setattr__(self, "policy", SDPolicyConfig(**self.policy))
        if self.method not in METHODS:
            raise ValueError(f"{OPTION}.method={self.method!r}: one of {sorted(METHODS)}")
        folder = Path(self.drafter)
        for name in ("config.json", "model.safetensors"):
            if not (folder / name).is_file():
                raise ValueError(f"{OPTION}.drafter={self.drafter}: no {name} there "
                                 "(export a drafter with `tlt-verl drafter export`)")
        if self.poll_interval_s <= 0:
            raise ValueError(f"{OPTION}.poll_interval_s={self.poll_interval_s}: must be > 0")

    @classmethod
    def from_rollout(cls, rollout_config) -> Optional["AdaptiveRolloutConfig"]:
        """The `tlt_sd` block of a verl RolloutConfig, or None when SD is not asked for."""
        custom = getattr(rollout_config, "custom", None) or {}
        block = custom.get(KEY) if hasattr(custom, "get") else None
        if block is None:
            return None
        block = dict(block)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(block) - known)
        if unknown:
            raise ValueError(f"{OPTION}: unknown option(s) {unknown}; known: {sorted(known)}")
        if "drafter" not in block:
            raise ValueError(f"{OPTION}.drafter: missing (the exported drafter folder to serve)")
        if isinstance(block.get("policy"), Mapping):
            policy = dict(block["policy"])
            if isinstance(policy.get("bandit"), Mapping):
                policy["bandit"] = dict(policy["bandit"])
            block["policy"] = policy
        return cls(**block)

    @property
    def max_k(self) -> int:
        return max(self.policy.bandit.arms)

    def speculative_config(self, max_num_seqs: int) -> dict[str, Any]:
        """vLLM's speculative_config: started at the largest arm, with a run-time schedule."""
        # The policy replaces the schedule at once; vLLM needs one at start to build its lookup.
        return drafter_speculative_config(self.drafter, self.method, self.max_k,
                                          num_speculative_tokens_per_batch_size=[[1, max_num_seqs, self.max_k]])


def drafter_speculative_config(folder: str, method: str, k: int, **extra: Any) -> dict[str, Any]:
    """vLLM's speculative_config for an exported drafter folder, checked lossless: a drafter trained
    for parallel drafting (`--parallel-drafting`) is served with it, all k drafts from one forward."""
    from tlt_verl.drafter.export import folder_parallel_drafting

    spec = {"method": METHODS[method], "model": str(folder), "num_speculative_tokens": k, **extra}
    if folder_parallel_drafting(folder):
        spec["parallel_drafting"] = True
    check_speculative_config(spec)
    return spec


def vllm_capture_grid(max_size: int) -> list[int]:
    """vLLM 0.30's default CUDA-graph sizes (VllmConfig._set_cudagraph_sizes): 1, 2, 4, then
    multiples of 8 below 256, then multiples of 16. A batch runs in the smallest captured size
    that holds it, so graphs off this grid would only add sizes vLLM never pads to."""
    grid = [s for s in (1, 2, 4) if s <= max_size] + list(range(8, min(max_size + 1, 256), 8))
    return grid + list(range(256, max_size + 1, 16))


def cuda_graph_capture_sizes(config: AdaptiveRolloutConfig, max_num_seqs: int, max_tokens: int) -> list[int]:
    """Token counts to capture CUDA graphs for: b * (1 + k), for every k the policy may give batch
    b, rounded up to vLLM's own grid.

    A uniform decode step of batch b under k speculative tokens runs b * (1 + k) tokens. Capturing
    every arm at every batch size would hold graphs for strategies that never run there: above
    the threshold only k = 0 runs, so the pool grows with the threshold, not with max_num_seqs x arms.
    """
    threshold = config.policy.threshold
    arms = config.policy.bandit.arms
    grid = vllm_capture_grid(max_tokens)
    needed = set(range(1, max_num_seqs + 1))  # k = 0 may run at any batch size
    for b in range(1, min(threshold, max_num_seqs) + 1):
        needed.update(b * (1 + k) for k in arms)
    return sorted({next(g for g in grid if g >= n) for n in needed if n <= grid[-1]})


def cuda_graph_engine_args(config: AdaptiveRolloutConfig, max_num_seqs: int, max_tokens: int,
                           on_gpu: bool, user: Optional[Mapping] = None) -> dict[str, Any]:
    """The engine arguments of the graph pool: on GPU the user's compilation config (`user`, from
    engine_kwargs) with the pool's capture sizes added, unless the user gave sizes; on CPU nothing."""
    if not config.cuda_graph_pool:
        return {}
    if not on_gpu:
        logger.info("%s.cuda_graph_pool: not applicable on CPU (the engine runs eagerly)", OPTION)
        return {}
    merged = dict(user or {})
    if merged.get("cudagraph_capture_sizes"):
        logger.info("%s.cuda_graph_pool: the engine's compilation_config gives cudagraph_capture_sizes; kept", OPTION)
        return {"compilation_config": merged}
    sizes = cuda_graph_capture_sizes(config, max_num_seqs, max_tokens)
    logger.info("%s.cuda_graph_pool: %d CUDA graph sizes (largest %d tokens)", OPTION, len(sizes), sizes[-1])
    return {"compilation_config": {**merged, "cudagraph_capture_sizes": sizes}}
