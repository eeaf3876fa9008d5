"""The folders an engine environment names (replica.engine_env), made before the engine starts.

Each engine keeps its own VLLM_CACHE_ROOT and socket folder, so that engines never share compile
caches or sockets. One thing in that cache is worth sharing: what vLLM learns about a model class
(`<VLLM_CACHE_ROOT>/modelinfos/`, one JSON per class, keyed by the hash of the class's source
file, written atomically). On a miss vLLM learns it in a fresh interpreter that imports vLLM, so
that the parent never initialises CUDA: 13-16 s per class on a 2-core machine, twice for an
engine with a drafter (target and drafter class), at every start with a new cache root. Each
engine's `modelinfos` is therefore a link to one folder per user, and that cost is paid once per
machine, not once per engine (an engine with a drafter and a new cache root: 72 s to start
against 29 s; README).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping

logger = logging.getLogger(__name__)

# Where the shared model-class info lives; the default follows vLLM's own cache (XDG_CACHE_HOME).
MODELINFO_DIR_ENV = "TLT_VLLM_MODELINFO_DIR"
FOLDER_KEYS = ("VLLM_RPC_BASE_PATH", "VLLM_CACHE_ROOT")


def shared_modelinfo_dir() -> Path:
    explicit = os.environ.get(MODELINFO_DIR_ENV)
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "tlt" / "vllm-modelinfos"


def make_engine_dirs(env: Mapping[str, str]) -> None:
    """Create the socket and cache folders `env` names, the cache's `modelinfos` linked to the shared one."""
    for key in FOLDER_KEYS:
        if env.get(key):
            Path(env[key]).mkdir(parents=True, exist_ok=True)
    if env.get("VLLM_CACHE_ROOT"):
        link_modelinfos(Path(env["VLLM_CACHE_ROOT"]))


def link_modelinfos(cache_root: Path) -> None:
    link, shared = cache_root / "modelinfos", shared_modelinfo_dir()
    if link.is_symlink() or link.exists():
        return  # linked already, or a cache of its own that vLLM keeps using
    try:
        shared.mkdir(parents=True, exist_ok=True)
        os.symlink(shared, link, target_is_directory=True)
    except FileExistsError:
        pass  # another engine of the same root linked it first
    except OSError as e:
        # Only a cost: vLLM fills a folder of its own, as without the link.
        logger.info("vLLM model-class info not shared (%s): this engine learns it itself", e)
