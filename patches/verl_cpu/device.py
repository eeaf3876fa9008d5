"""A device module for verl's CPU platform.

verl calls its platform's device module like `torch.cuda` (memory stats, RNG state, NVTX,
`current_device`). `torch.cpu` has only part of that API; this fills the rest with the
meaning each call has on a machine without an accelerator.
"""
from __future__ import annotations

import contextlib
import types

import psutil
import torch


class _Nvtx(types.SimpleNamespace):
    @staticmethod
    def range_push(msg):
        return 0

    @staticmethod
    def range_pop():
        return 0

    @staticmethod
    @contextlib.contextmanager
    def range(msg, *args, **kwargs):
        yield


class CPUDeviceModule(types.ModuleType):
    """`torch.cpu` plus the `torch.cuda`-style calls verl makes."""

    def __init__(self):
        super().__init__("tlt_verl.patches.verl_cpu.device_module")
        self.nvtx = _Nvtx()

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    # verl moves tensors with `.to(get_device_id())`: an integer would mean CUDA device 0.
    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def set_device(device):
        return None

    @staticmethod
    def synchronize(device=None):
        return None

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def memory_allocated(device=None):
        return psutil.Process().memory_info().rss

    memory_reserved = memory_allocated
    max_memory_allocated = memory_allocated
    max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device=None):
        return None

    @staticmethod
    def mem_get_info(device=None):
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None):
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_device_name(device=None):
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        return types.SimpleNamespace(name="cpu", total_memory=psutil.virtual_memory().total)


device_module = CPUDeviceModule()
