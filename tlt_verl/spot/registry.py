"""The drafter service of this process, if one was started (by the TLT actor worker).

Other components of the same worker process reach it here instead of through the worker
object: the rollout weight-sync adapter hands it each step's frozen target tensors.
"""
from __future__ import annotations

from typing import Optional

_service = None


def set_service(service) -> None:
    global _service
    _service = service


def service() -> Optional[object]:
    return _service
