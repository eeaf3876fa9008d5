"""Target hidden states for drafter training: capturing them from a target forward pass, and
the bounded buffer of recent RL steps the drafter trains on.

Capture from verl's actor update is ``tlt_verl.capture.verl_capture`` (it imports verl, so
it is not imported here)."""
from .buffer import BufferConfig, DataBuffer, Sample
from .hf_capture import Captured, capture_hidden, capture_samples

__all__ = ["BufferConfig", "Captured", "DataBuffer", "Sample", "capture_hidden", "capture_samples"]
