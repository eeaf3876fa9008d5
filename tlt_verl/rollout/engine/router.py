"""Prompt-affinity routing for verl's rollout load balancer.

GRPO samples n responses per prompt. verl's default balancer spreads them over replicas by
in-flight count; this one sends every sample of a prompt to the replica that got its first
sample, so the group shares one prefix-cache entry, and balances prompts (not samples) across
replicas by in-flight count. It is loaded through verl's own extension point,
`actor_rollout_ref.rollout.router_config_path` (see recipes/router_prompt_affinity.yaml).
"""
from __future__ import annotations

import hashlib
import random
from typing import Any, Optional

from cachetools import LRUCache
from verl.workers.rollout.router import GlobalRequestLoadBalancer

from tlt_verl.patches import require_attr

# A rollout step holds at most a few thousand prompts; older keys are irrelevant.
MAX_PROMPTS = 65536


class PromptAffinityRouter(GlobalRequestLoadBalancer):
    def __init__(self, servers: dict[str, Any], config: Optional[dict] = None):
        super().__init__(servers)
        for name in ("_servers", "_inflight_requests"):
            require_attr(self, name, "prompt-affinity router")
        self._prompt_to_server: LRUCache = LRUCache(maxsize=MAX_PROMPTS)
        self._rng = random.Random((config or {}).get("seed", 0))

    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids"]

    def acquire_server(self, request_id: str, prompt_ids: Optional[list[int]] = None, **_) -> tuple[str, Any]:
        if prompt_ids is None:
            return super().acquire_server(request_id)
        key = hashlib.blake2b(repr(list(prompt_ids)).encode(), digest_size=16).digest()
        server_id = self._prompt_to_server.get(key)
        if server_id not in self._inflight_requests:
            low = min(self._inflight_requests.values())
            server_id = self._rng.choice(sorted(s for s, n in self._inflight_requests.items() if n == low))
            self._prompt_to_server[key] = server_id
        self._inflight_requests[server_id] += 1
        return server_id, self._servers[server_id]

    def clear_sticky_cache(self) -> dict:
        self._prompt_to_server.clear()
        return super().clear_sticky_cache()
