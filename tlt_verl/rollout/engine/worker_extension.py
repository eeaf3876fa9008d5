"""Methods added to every vLLM worker (vLLM's `worker_extension_cls`), called by collective_rpc.

Built on verl's own `vLLMColocateWorkerExtension`, so the target's weights arrive the way verl's
vLLM rollout sends them: `ServerAdapter.update_weights` (verl) streams them in buckets with
`BucketedWeightSender` over ZMQ, through CUDA IPC on GPU and shared memory on CPU, and the worker
receives them with verl's `BucketedWeightReceiver` on the socket verl's naming gives
(`_get_zmq_handle`). No file, no host copy of the model on the trainer side.

What differs from verl is how a bucket is loaded: through vLLM's layerwise reload (the path of
`GPUModelRunner.reload_weights` for checkpoint-format weights) on every platform. vLLM-CPU repacks
Linear weights into oneDNN blobs after loading and leaves `.weight` empty, so the plain
`load_weights` verl calls fails there; the layerwise reload restores each layer, loads it and
processes it again, on GPU as on CPU, so both run one path.
"""
from __future__ import annotations

import torch
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from tlt_verl.patches._guard import require_attr
from tlt_verl.patches.vllm_sd import catch_up
from tlt_verl.rollout.engine.drafter_reload import DrafterExtension
from tlt_verl.rollout.engine.model_runner import runner_report

WHAT = "target weight sync"


class TLTWorkerExtension(DrafterExtension, vLLMColocateWorkerExtension):
    def update_weights_from_ipc(self, peft_config: dict | None = None, base_sync_done: bool = False,
                                use_shm: bool = False) -> None:
        """Receive the actor's weights from verl's sender and load them into the target in place.

        The drafter is left alone: its own layers are not in the stream, and the embedding / LM
        head it shares with the target are the target's.
        """
        if peft_config:
            raise ValueError(f"{WHAT}: LoRA adapters are not supported with tlt_vllm; merge them "
                             f"(actor_rollout_ref.model.lora_rank=0)")
        from vllm.model_executor.model_loader.reload import layerwise

        init = require_attr(layerwise, "initialize_layerwise_reload", WHAT)
        finalize = require_attr(layerwise, "finalize_layerwise_reload", WHAT)
        if self.device is None:
            self.device = torch.device("cpu") if not torch.cuda.is_available() else torch.device("cuda", self.local_rank)
        model = self.model_runner.get_model()

        def on_bucket(weights, is_last: bool) -> None:
            # The layerwise loader keeps a layer's tensors until the layer is complete, and the
            # bucket buffer is overwritten by the next bucket: it must hold copies.
            model.load_weights((name, t.clone()) for name, t in weights)

        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)
        init(model)
        try:
            receiver.receive_weights(on_bucket_received=on_bucket)
        finally:
            # Layers that received nothing get their previous kernel tensors back.
            finalize(model, self.model_runner.model_config)

    def tlt_model_runner(self, speculative: bool) -> dict:
        return runner_report(self.model_runner, speculative)

    def tlt_release_sd_catch_up(self) -> dict:
        return catch_up.release(self.model_runner)

    def tlt_sd_catch_up_stats(self) -> dict:
        return catch_up.stats(self.model_runner)
