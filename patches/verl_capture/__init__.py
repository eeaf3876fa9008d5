"""Feed the drafter's DataBuffer from verl 0.9.1's actor update (tlt_verl.capture.verl_capture).

Two wraps, both inert until capture is enabled in the process:

- ``ActorRolloutRefWorker.update_actor`` opens a capture pass (hooks on the actor's decoder)
  around the stock method, limited to the samples it was handed (its first epoch). The log-prob
  and reference passes are left alone: TLT needs neither, so bypass mode may skip them.
- ``FSDPEngineWithLMHead.prepare_model_outputs``, where the engine turns a forward's packed output
  into per-sample tensors, hands the same micro-batch and the engine's own un-padding to that pass.

With capture off, ``update_actor`` calls the stock method directly and ``prepare_model_outputs``
returns the stock result after one dictionary lookup; no hook exists.
"""
from __future__ import annotations

import functools
import inspect

from tlt_verl.patches._guard import PatchError, require_attr, require_version, when_imported

VERL_SPEC = "==0.9.1"
WHAT = "verl hidden-state capture"
_MARK = "_tlt_capture"
_applied = False

# The stock signature the engine wrap forwards to; a different one means the engine changed.
_ENGINE_PARAMS = ["self", "output", "output_args", "micro_batch", "logits_processor_func"]


def apply() -> None:
    global _applied
    if _applied:
        return
    require_version("verl", VERL_SPEC, WHAT)
    when_imported("verl.workers.engine_workers", patch_worker)
    when_imported("verl.workers.engine.fsdp.transformer_impl", patch_engine)
    _applied = True


def patch_worker(mod) -> None:
    worker_cls = require_attr(mod, "ActorRolloutRefWorker", WHAT)
    original = require_attr(worker_cls, "update_actor", WHAT)
    if getattr(original, _MARK, False):
        return
    if inspect.iscoroutinefunction(original):
        raise PatchError(f"{WHAT}: {worker_cls.__name__}.update_actor is async; the patch wraps a plain method")
    from tlt_verl.capture import verl_batch, verl_capture

    @functools.wraps(original)  # keeps verl's dispatch metadata (register's MAGIC_ATTR)
    def update_actor(self, data, *args, **kwargs):
        if not verl_capture.enabled() or getattr(self, "actor", None) is None:
            return original(self, data, *args, **kwargs)
        engine = self.actor.engine
        if not getattr(getattr(type(engine), "prepare_model_outputs", None), _MARK, False):
            raise PatchError(f"{WHAT}: the actor engine {type(engine).__name__} is not an FSDP engine with an "
                             f"LM head; capture supports actor_rollout_ref.actor.strategy=fsdp/fsdp2")
        capture = verl_capture.capture_pass(engine, engine.module, limit=verl_batch.sample_count(data))
        if capture is None:       # disabled since the check above
            return original(self, data, *args, **kwargs)
        with capture:
            return original(self, data, *args, **kwargs)

    setattr(update_actor, _MARK, True)
    worker_cls.update_actor = update_actor


def patch_engine(mod) -> None:
    engine_cls = require_attr(mod, "FSDPEngineWithLMHead", WHAT)
    original = require_attr(engine_cls, "prepare_model_outputs", WHAT)
    require_attr(engine_cls, "_gather_and_unpad_packed", WHAT)
    tu = require_attr(mod, "tu", WHAT)
    if getattr(original, _MARK, False):
        return
    params = list(inspect.signature(original).parameters)
    if params != _ENGINE_PARAMS:
        raise PatchError(f"{WHAT}: {engine_cls.__name__}.prepare_model_outputs takes {params}, "
                         f"written for {_ENGINE_PARAMS}")
    from tlt_verl.capture import verl_capture

    @functools.wraps(original)
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        result = original(self, output, output_args, micro_batch, logits_processor_func)
        capture = verl_capture.active_pass(self)
        if capture is not None:
            packed = bool(tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True))
            pad = int(output_args.get("pad_size", 0)) if packed else 0
            capture.collect(micro_batch, packed=packed,
                            gather=(lambda t: self._gather_and_unpad_packed(t, pad)) if packed else None)
        return result

    setattr(prepare_model_outputs, _MARK, True)
    engine_cls.prepare_model_outputs = prepare_model_outputs
