"""A saved verl step, exported for serving: the policy in Hugging Face format beside its drafter.

    <trainer.default_local_dir>/tlt/export/step_N/
        policy/            the actor of global_step_N in Hugging Face format (verl's model merger)
        drafter/vllm/      the freshest rank's drafter of that step, in vLLM's EAGLE layout
        drafter/sglang/    the same drafter in SGLang's layout
        vllm_speculative_config.json
                           vLLM's --speculative-config for that drafter, its model path relative to
                           the export folder (served from there: `vllm serve policy --speculative-config
                           "$(cat vllm_speculative_config.json)"`); absent when the step has no drafter
        manifest.json      step, acceptance at export, serving settings, sha256 of every file

`export_step` reads only verl's checkpoint folder (`global_step_N/actor`, `global_step_N/tlt_drafter`),
so the TLT trainer calls it after each save (tlt_verl/integration/tlt_trainer.py) and `./tlt export`
runs it on any saved step. The folder is built under a temporary name and renamed into place:
a reader sees a whole export or none. The manifest is written last, inside it.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from tlt_verl.utils.files import build_dir_atomically, sha256_file

FORMAT = 1
MANIFEST = "manifest.json"
VLLM_SPEC_CONFIG = "vllm_speculative_config.json"
EXPORT_DIR = "export"              # under the run's tlt work dir
STEP_PREFIX = "step_"
POLICY = "policy"
DRAFTER = "drafter"
# Inside verl's global_step_N folder: the actor (verl's own) and the drafters TLT saves beside it.
ACTOR_SUBDIR = "actor"
DRAFTER_SUBDIR = "tlt_drafter"
ENGINE_LAYOUTS = ("vllm", "sglang")


class ExportError(ValueError):
    """One line naming the path at fault."""


@dataclass(frozen=True)
class ExportConfig:
    """`tlt.export`: what the run keeps for serving."""
    # At each verl checkpoint save (trainer.save_freq), export that step for serving.
    enable: bool = True
    # After the last step, save verl's checkpoint (when trainer.save_freq did not) and export it.
    at_end: bool = True
    layouts: tuple[str, ...] = ENGINE_LAYOUTS
    # Exports kept, newest first; null: as many as trainer.max_actor_ckpt_to_keep (all if unset).
    keep: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "layouts", tuple(self.layouts))
        unknown = [x for x in self.layouts if x not in ENGINE_LAYOUTS]
        if not self.layouts or unknown:
            raise ValueError(f"layouts={list(self.layouts)}: give one or more of {list(ENGINE_LAYOUTS)}")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep={self.keep}: must be >= 1 (or null)")


@dataclass(frozen=True)
class ServeHints:
    """How the run sampled, recorded in the manifest: `./tlt serve` serves the same way."""
    dtype: str = "auto"                    # the rollout's dtype (verl's merger writes bfloat16)
    max_model_len: Optional[int] = None    # prompt + response length of the rollout
    num_speculative_tokens: int = 3        # the largest k the adaptive policy drafted


# ---------------------------------------------------------------------------- writing

def merge_policy(actor_dir: Path, out: Path) -> None:
    """verl's FSDP model merger (`python -m verl.model_merger merge --backend fsdp`), in process."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    for need in (actor_dir / "fsdp_config.json", actor_dir / "huggingface" / "config.json"):
        if not need.is_file():
            raise ExportError(f"{need}: missing (not a verl FSDP actor checkpoint)")
    world = int(json.loads((actor_dir / "fsdp_config.json").read_text()).get("world_size", 0))
    for rank in range(world):
        shard = actor_dir / f"model_world_size_{world}_rank_{rank}.pt"
        if not shard.is_file():
            raise ExportError(f"{shard}: missing (the actor checkpoint has {world} shards)")
    merger = FSDPModelMerger(ModelMergerConfig(operation="merge", backend="fsdp", local_dir=str(actor_dir),
                                               target_dir=str(out),
                                               hf_model_config_path=str(actor_dir / "huggingface")))
    merger.merge_and_save()
    merger.cleanup()


def freshest_drafter(drafter_dir: Path, rank: Optional[int] = None):
    """(rank, loaded checkpoint) of the drafter to serve: ``rank``'s, or the one with the highest
    state version (ties: the lowest rank)."""
    from tlt_verl.drafter.checkpoint import CheckpointError, load_latest

    ranks = sorted(int(p.name.removeprefix("rank_")) for p in drafter_dir.glob("rank_*")
                   if p.name.removeprefix("rank_").isdigit())
    if rank is not None:
        ranks = [rank]
    if not ranks:
        raise ExportError(f"{drafter_dir}: no rank_* drafter checkpoints")
    best = None
    for r in ranks:
        try:
            loaded = load_latest(drafter_dir / f"rank_{r}")
        except CheckpointError as e:
            raise ExportError(str(e)) from None
        version = int((loaded.state.get("service") or {}).get("state_version", 0))
        if best is None or version > best[2]:
            best = (r, loaded, version)
    return best[0], best[1]


def vllm_speculative_config(folder: Path, drafter_rel: str, kind: str, k: int) -> dict:
    """vLLM's speculative config for the drafter at ``folder/drafter_rel``, as the rollout builds
    it (parallel drafting when the drafter was trained for it: sequential drafting from such a
    drafter accepts far less), with the model path relative to ``folder`` so that the export can
    move."""
    from tlt_verl.rollout.config import drafter_speculative_config

    return {**drafter_speculative_config(str(folder / drafter_rel), kind, k), "model": drafter_rel}


def _step_of(step_dir: Path) -> int:
    m = re.fullmatch(r"global_step_(\d+)", step_dir.name)
    if m is None:
        raise ExportError(f"{step_dir}: not a verl global_step_N folder")
    return int(m.group(1))


def export_step(step_dir: str | Path, out_root: str | Path, *, drafter_rank: Optional[int] = None,
                acceptance: Optional[dict] = None, serve: ServeHints = ServeHints(),
                layouts: tuple[str, ...] = ENGINE_LAYOUTS) -> Path:
    """Export verl's ``global_step_N`` folder to ``out_root/step_N`` (replaced if it exists).

    ``acceptance``: what the run measured of its drafter (recorded as given). A step saved without
    TLT (no ``tlt_drafter``) exports the policy alone."""
    from tlt_verl.drafter.export import export_drafter
    from tlt_verl.drafter.warmup import checkpoint_drafter

    step_dir = Path(step_dir).resolve()
    if not step_dir.is_dir():
        raise ExportError(f"{step_dir}: no such checkpoint folder")
    step = _step_of(step_dir)

    def build(tmp: Path) -> dict:
        t0 = time.time()
        merge_policy(step_dir / ACTOR_SUBDIR, tmp / POLICY)
        drafter_info = None
        if (step_dir / DRAFTER_SUBDIR).is_dir():
            rank, loaded = freshest_drafter(step_dir / DRAFTER_SUBDIR, drafter_rank)
            drafter = checkpoint_drafter(loaded, tmp / POLICY)
            paths = {layout: f"{DRAFTER}/{layout}" for layout in layouts}
            for layout, rel in paths.items():
                export_drafter(drafter, tmp / rel, engine=layout)
            service = loaded.state.get("service") or {}
            drafter_info = {"kind": drafter.cfg.kind, "rank": rank, "layouts": paths,
                            "state_version": int(service.get("state_version", 0)),
                            "checkpoint": str(loaded.path)}
            if "vllm" in paths:
                spec = vllm_speculative_config(tmp, paths["vllm"], drafter.cfg.kind, serve.num_speculative_tokens)
                (tmp / VLLM_SPEC_CONFIG).write_text(json.dumps(spec) + "\n")
        policy_cfg = json.loads((tmp / POLICY / "config.json").read_text())
        manifest = {
            "format": FORMAT, "step": step, "source": str(step_dir),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "policy": {"path": POLICY, "architecture": (policy_cfg.get("architectures") or [None])[0],
                       "dtype": policy_cfg.get("dtype") or policy_cfg.get("torch_dtype"),
                       "merged_with": "verl.model_merger (fsdp)"},
            "drafter": drafter_info,
            "acceptance": acceptance,
            "serve": asdict(serve),
            "files": {rel: {"bytes": (tmp / rel).stat().st_size, "sha256": sha256_file(tmp / rel)}
                      for rel in _files(tmp)},
            "export_s": round(time.time() - t0, 2),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        return manifest

    target = Path(out_root) / f"{STEP_PREFIX}{step}"
    build_dir_atomically(target, build)
    return target


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def prune_exports(out_root: str | Path, keep: Optional[int]) -> list[Path]:
    """Remove all but the ``keep`` newest exports under ``out_root``; returns what was removed."""
    if keep is None:
        return []
    old = find_exports(out_root)[:-keep]
    for folder in old:
        shutil.rmtree(folder, ignore_errors=True)
    return old


# ---------------------------------------------------------------------------- reading

@dataclass(frozen=True)
class Export:
    folder: Path
    manifest: dict[str, Any] = field(repr=False)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def policy(self) -> Path:
        return self.folder / self.manifest["policy"]["path"]

    def drafter(self, layout: str = "vllm") -> Optional[Path]:
        d = self.manifest.get("drafter")
        return self.folder / d["layouts"][layout] if d and layout in d.get("layouts", {}) else None

    @property
    def serve(self) -> ServeHints:
        return ServeHints(**(self.manifest.get("serve") or {}))

    def vllm_speculative_config(self) -> dict:
        """The export's vllm_speculative_config.json, its model path made absolute (a server started
        from anywhere finds the drafter)."""
        path = self.folder / VLLM_SPEC_CONFIG
        if VLLM_SPEC_CONFIG not in self.manifest["files"]:
            raise ExportError(f"{path}: not in this export (written before TLT exported it; "
                              f"export the step again: ./tlt export {self.manifest.get('source', 'global_step_N')})")
        try:
            spec = json.loads(path.read_text())
            spec["model"] = str(self.folder / spec["model"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ExportError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
        return spec


def read_export(folder: str | Path, hashes: bool = False) -> Export:
    """An export folder, every file its manifest lists present at its size (and, with ``hashes``,
    its sha256); otherwise an ExportError naming the path."""
    folder = Path(folder)
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        manifest["policy"]["path"]
    except FileNotFoundError:
        raise ExportError(f"{path}: missing (not an export folder)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{path}: unreadable manifest ({type(e).__name__}: {e})") from None
    if manifest.get("format") != FORMAT:
        raise ExportError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT}")
    for rel, info in files.items():
        f = folder / rel
        if not f.is_file():
            raise ExportError(f"{f}: missing (listed in {path})")
        if f.stat().st_size != info["bytes"] or (hashes and sha256_file(f) != info["sha256"]):
            raise ExportError(f"{f}: does not match its sha256/size in {path} (changed or truncated)")
    return Export(folder, manifest)


def find_exports(path: str | Path) -> list[Path]:
    """Export folders at or under ``path`` (a run folder, a checkpoint folder, an export root or an
    export itself), oldest first by step."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return [path]
    found = [m.parent for m in path.rglob(MANIFEST)
             if re.fullmatch(rf"{STEP_PREFIX}\d+", m.parent.name) and m.parent.parent.name == EXPORT_DIR]
    return sorted(found, key=lambda p: (int(p.name.removeprefix(STEP_PREFIX)), p.stat().st_mtime))


def latest_export(path: str | Path, hashes: bool = False) -> Export:
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path}: no such folder")
    found = find_exports(path)
    if not found:
        raise ExportError(f"{path}: no export found (looked for {EXPORT_DIR}/{STEP_PREFIX}N/{MANIFEST} below it; "
                          f"a TLT run writes one at each checkpoint save and at its end)")
    return read_export(found[-1], hashes=hashes)
