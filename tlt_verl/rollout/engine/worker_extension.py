"""Methods added to every vLLM worker (vLLM's `worker_extension_cls`), called by collective_rpc.

Tensors sent through collective_rpc arrive as Python lists, so weights travel as a path to a
safetensors file written by the server adapter.
"""
from __future__ import annotations

from safetensors.torch import load_file

from tlt_verl.rollout.engine.drafter_reload import DrafterExtension
from tlt_verl.utils.files import sha256_file


class TLTWorkerExtension(DrafterExtension):
    def tlt_reload_target_weights(self, path: str) -> str:
        """Load the actor's weights into the target model; the drafter is left alone.

        vLLM-CPU repacks Linear weights into oneDNN blobs after loading, so a plain
        `load_weights` fails; `reload_weights` restores the layers, loads and repacks them.
        """
        state = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        return sha256_file(path)


