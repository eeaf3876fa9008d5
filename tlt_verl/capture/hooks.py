"""Forward hooks that keep the hidden states a drafter needs from a forward pass someone else runs.

``hf_capture`` runs its own forward; here the forward belongs to the caller (verl's actor engine),
so the states are taken on the side while it runs: the decoder's output (after the final norm,
HF ``hidden_states[-1]``) and the residual stream entering each aux layer ``k`` (HF
``hidden_states[k]``; ``k = 0`` is the token embedding). The layout of the tensors is whatever the
forward used ([1, packed tokens, H] or [B, S, H]); splitting them per sample is the caller's job.

Hooks hold references to activations only until :meth:`HiddenStateHooks.take`; nothing is copied.
They record only inside a forward of the whole decoder: under gradient checkpointing the backward
pass re-runs each decoder layer (so the aux pre-hooks fire again) but not the decoder itself.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def find_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The outermost submodule shaped like a Llama/Qwen2 decoder (embeddings, layers, final norm).

    Searching rather than reading ``model.model`` keeps wrappers transparent: FSDP keeps the
    tree, PEFT nests the causal LM two levels deeper."""
    for m in model.modules():
        if (isinstance(getattr(m, "layers", None), torch.nn.ModuleList)
                and isinstance(getattr(m, "norm", None), torch.nn.Module)
                and isinstance(getattr(m, "embed_tokens", None), torch.nn.Module)):
            return m
    raise ValueError(f"capture: {type(model).__name__} has no decoder (embed_tokens, layers, norm) "
                     f"where a Llama/Qwen2 causal LM keeps it")


class HiddenStateHooks:
    """Hooks on ``model``'s decoder for as long as the object is open (a context manager).

    After each forward, :meth:`take` returns ``(final, aux)``: ``final`` [..., H] and ``aux``
    [..., len(aux_layer_ids) * H] (aux states concatenated in layer order, the order vLLM feeds an
    EAGLE-3 drafter), or None without aux layer ids."""

    def __init__(self, model: torch.nn.Module, aux_layer_ids: Sequence[int] = ()):
        self.decoder = find_decoder(model)
        n = len(self.decoder.layers)
        self.aux_layer_ids = tuple(aux_layer_ids)
        if any(not 0 <= k < n for k in self.aux_layer_ids):
            raise ValueError(f"capture: aux_layer_ids={list(self.aux_layer_ids)}: the target has {n} "
                             f"decoder layers, ids must be in [0, {n - 1}]")
        self._final: torch.Tensor | None = None
        self._aux: dict[int, torch.Tensor] = {}
        self._handles: list = []
        self._armed = False

    def __enter__(self) -> "HiddenStateHooks":
        self._handles.append(self.decoder.register_forward_pre_hook(self._on_decoder_input))
        self._handles.append(self.decoder.register_forward_hook(self._on_decoder_output))
        for k in self.aux_layer_ids:
            self._handles.append(self.decoder.layers[k].register_forward_pre_hook(self._on_layer_input(k),
                                                                                 with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._final, self._aux, self._armed = None, {}, False

    @property
    def pending(self) -> bool:
        """A forward ran whose states were not taken."""
        return self._final is not None or bool(self._aux)

    def _on_decoder_input(self, *_):
        self._armed = True

    def _on_decoder_output(self, _module, _args, output):
        hidden = getattr(output, "last_hidden_state", None)
        self._final = (output[0] if hidden is None else hidden).detach()
        self._armed = False

    def _on_layer_input(self, k: int):
        def hook(_module, args, kwargs):
            if self._armed:
                self._aux[k] = (args[0] if args else kwargs["hidden_states"]).detach()
        return hook

    def take(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The states of the last forward; each forward's states can be taken once."""
        final, aux = self._final, self._aux
        self._final, self._aux = None, {}
        missing = [k for k in self.aux_layer_ids if k not in aux]
        if final is None or missing:
            raise RuntimeError("capture: no forward of the hooked decoder since the last take() "
                               f"(final seen: {final is not None}, aux layers not seen: {missing})")
        cat = torch.cat([aux[k] for k in self.aux_layer_ids], dim=-1) if self.aux_layer_ids else None
        return final, cat
