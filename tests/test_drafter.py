"""The drafter models, packing, losses and checkpoint folders, on a tiny random Qwen2 target."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from tlt_verl.drafter import DrafterConfig, LossConfig, build_drafter, default_aux_layer_ids, target_tensors
from tlt_verl.drafter.export import export_drafter, load_drafter
from tlt_verl.drafter.loss import drafter_loss
from tlt_verl.drafter.packing import BlockCausal, PackedBatch, align_sample, pack, shift_within_samples

torch.set_num_threads(1)
VOCAB = 320


def qwen2_config(**over):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                tie_word_embeddings=False)
    return Qwen2Config(**{**base, **over})


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(qwen2_config()).eval()


def drafter_for(target, kind, **cfg_over):
    torch.manual_seed(1)
    cfg = DrafterConfig.from_target(target.config, kind=kind, **cfg_over)
    return build_drafter(cfg, *target_tensors(target))


@torch.no_grad()
def samples_for(target, kind, lengths, seed=0, prompt_len=3, aux_ids=None):
    """Aligned training samples: random tokens, the target's hidden states, response mask."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        hs = target(ids[None], output_hidden_states=True).hidden_states
        aux = torch.cat([hs[k][0] for k in aux_ids], -1) if kind == "eagle3" else None
        mask = (torch.arange(n) >= prompt_len).float()
        out.append(align_sample(ids, hs[-1][0], mask, aux))
    return out


# ---------------------------------------------------------------- config

def test_config_from_qwen2_target_and_validation():
    tc = qwen2_config()
    cfg = DrafterConfig.from_target(tc, kind="eagle3")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.vocab_size, cfg.rope_theta) == (64, 4, 2, 16, VOCAB, tc.rope_parameters["rope_theta"])
    assert cfg.aux_layer_ids == (0, 2, 3) and cfg.fc_in_features == 3 * 64
    assert DrafterConfig.from_target(tc).fc_in_features == 128
    from transformers import LlamaConfig
    llama = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                        intermediate_size=200, num_hidden_layers=8, vocab_size=1000, attention_bias=True)
    lc = DrafterConfig.from_target(llama, kind="eagle3")
    assert (lc.head_dim, lc.num_key_value_heads, lc.aux_layer_ids, lc.attention_bias) == (32, 2, (2, 4, 5), False)
    assert default_aux_layer_ids(32) == (2, 16, 29)          # SGLang / vLLM default
    assert default_aux_layer_ids(2) == (0, 1)                 # small targets: distinct, in range
    with pytest.raises(ValueError, match=r"^DrafterConfig.aux_layer_ids=\[1, 4\]: ids must be in \[0, 3\]$"):
        DrafterConfig.from_target(tc, kind="eagle3", aux_layer_ids=[1, 4])
    with pytest.raises(ValueError, match=r"^DrafterConfig.aux_layer_ids=\[2, 1\]: must be distinct and ascending$"):
        DrafterConfig.from_target(tc, kind="eagle3", aux_layer_ids=[2, 1])
    with pytest.raises(ValueError, match=r"^DrafterConfig.kind='medusa'"):
        DrafterConfig.from_target(tc, kind="medusa")
    with pytest.raises(ValueError, match=r"^DrafterConfig.draft_vocab_size: only for kind='eagle3'$"):
        DrafterConfig.from_target(tc, kind="eagle", draft_vocab_size=10)
    with pytest.raises(ValueError, match=r"^target model_type='gpt2'"):
        DrafterConfig.from_target(type("C", (), {"model_type": "gpt2"})())


# ---------------------------------------------------------------- frozen target tensors

@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_target_embedding_and_head_frozen_and_not_checkpointed(target, kind):
    drafter = drafter_for(target, kind)
    embed, head = target_tensors(target)
    before = embed.detach().clone(), head.detach().clone()
    trainable = {id(p) for p in drafter.trainable_parameters()}
    assert id(embed) not in trainable and id(head) not in trainable
    assert all(t.data_ptr() not in {p.data_ptr() for p in drafter.trainable_parameters()}
               for t in (embed, head))
    keys = set(drafter.state_dict())
    assert not any("target" in k or "embed" in k for k in keys), keys
    assert ("lm_head.weight" in keys) == (kind == "eagle3")   # EAGLE-3's own head, trainable
    # The drafter reads the target's storage, not a copy.
    assert drafter.target.embed_weight.data_ptr() == embed.data_ptr()

    batch = pack(samples_for(target, kind, [12, 9], aux_ids=drafter.cfg.aux_layer_ids), 24)
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-2, weight_decay=0.1)
    start = {k: v.clone() for k, v in drafter.state_dict().items()}
    for _ in range(3):
        loss, _ = drafter_loss(drafter, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.equal(embed, before[0]) and torch.equal(head, before[1])
    assert embed.grad is None and head.grad is None
    assert not torch.equal(drafter.state_dict()["fc.weight"], start["fc.weight"])


# ---------------------------------------------------------------- packing

def _only(batch: PackedBatch, sample: int) -> PackedBatch:
    """The same packed rows, with the loss restricted to one sample."""
    t = dict(batch.tensors, loss_mask=batch["loss_mask"] * (batch.seq_ids == sample))
    return PackedBatch(t, batch.position_ids, batch.seq_ids)


def _loss_and_grads(drafter, batch):
    drafter.zero_grad()
    loss, _ = drafter_loss(drafter, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}


def test_pack_positions_restart_and_mask_is_block_diagonal():
    s = [{"x": torch.arange(n)} for n in (3, 5, 2)]
    b = pack(s, 6)
    assert b.seq_ids.tolist() == [[1, 1, 1, 1, 1, -1], [0, 0, 0, 2, 2, -1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 1, 0]]
    m = b.block_causal().dense()[1]
    assert m[4].tolist() == [False, False, False, True, True, False]   # sample 2 sees only itself
    assert m[2].tolist() == [True, True, True, False, False, False]
    bounds, max_len = b.cu_seqlens()
    assert bounds.tolist() == [0, 5, 6, 9, 11, 12] and max_len == 5
    with pytest.raises(ValueError, match="sample 1 has 5 positions, more than row_len=4"):
        pack(s, 4)
    # trim: the rows end where the fullest one does.
    b = pack(s, 9, trim=True)
    assert b.seq_ids.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [2, 2, -1, -1, -1, -1, -1, -1]]
    assert pack(s, 9).seq_ids.shape == (2, 9)


def test_flash_varlen_path_is_guarded_off_cuda(target):
    drafter = drafter_for(target, "eagle")
    batch = pack(samples_for(target, "eagle", [6, 5]), 12)
    with pytest.raises(RuntimeError, match="flash-attn varlen is unavailable"):
        drafter_loss(drafter, batch, LossConfig(attention="flash_varlen"))
    with pytest.raises(ValueError, match="EAGLE-3 unrolling needs 'sdpa'"):
        drafter_loss(drafter_for(target, "eagle3"), batch, LossConfig(attention="flash_varlen"))


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_packed_samples_are_isolated(target, kind):
    drafter = drafter_for(target, kind)
    aux = drafter.cfg.aux_layer_ids
    a, b, c = samples_for(target, kind, [10, 7, 9], seed=1, aux_ids=aux)
    c2 = samples_for(target, kind, [9], seed=2, aux_ids=aux)[0]          # a different sample C
    row = lambda ss: pack(ss, 26)
    assert row([a, b, c]).seq_ids.shape[0] == 1                           # all in one row
    for i, alone in ((0, a), (1, b)):
        packed = _loss_and_grads(drafter, _only(row([a, b, c]), i))
        changed = _loss_and_grads(drafter, _only(row([a, b, c2]), i))
        single = _loss_and_grads(drafter, pack([alone], 12))
        for other in (changed, single):
            torch.testing.assert_close(packed[0], other[0], atol=1e-6, rtol=1e-5)
            for n in packed[1]:
                torch.testing.assert_close(packed[1][n], other[1][n], atol=1e-6, rtol=1e-5, msg=n)


def test_shift_within_samples_stops_at_sample_end():
    seq_ids = torch.tensor([[0, 0, 0, 1, 1, -1]])
    x = torch.tensor([[10, 11, 12, 20, 21, 0]])
    shifted, valid = shift_within_samples(x, seq_ids, 1)
    assert valid.tolist() == [[True, True, False, True, False, False]]
    assert shifted[valid].tolist() == [11, 12, 21]


# ---------------------------------------------------------------- EAGLE-3 unrolling

def test_eagle3_unroll_matches_step_by_step_drafting(target):
    """Step j at slot t must see what inference would: step-0 keys up to t, then its own."""
    drafter = drafter_for(target, "eagle3").eval()
    (s,) = samples_for(target, "eagle3", [9], aux_ids=drafter.cfg.aux_layer_ids)
    b = pack([s], 8)
    ids, hid, pos = b["input_ids"], b["hidden"], b.position_ids
    outs = drafter.unroll(ids, hid, pos, b.seq_ids, num_steps=3)
    assert [o.shape for o, _ in outs] == [(1, 8, 64)] * 3
    assert [v.sum().item() for _, v in outs] == [8, 7, 6]
    with torch.no_grad():
        out0, pre0, kv0 = drafter.step(ids, drafter.fc(hid), pos)
        torch.testing.assert_close(outs[0][0], out0)
        for t in range(6):                       # chains starting at slots 0..5, two more steps
            past, g = [tuple(x[:, :, : t + 1] for x in kv0)], pre0[:, t: t + 1]
            for j in (1, 2):
                out, g, kv = drafter.step(ids[:, t + j: t + j + 1], g, pos[:, t: t + 1] + j,
                                          torch.ones(1, 1, t + 1 + j, dtype=torch.bool), None, past)
                past.append(kv)
                torch.testing.assert_close(outs[j][0][:, t], out[:, 0], atol=1e-5, rtol=1e-5)


def test_parallel_eagle3_unroll_matches_one_forward_with_mask_slots(target):
    """Parallel drafting: the drafts at t+2.. come from mask slots in the same forward as slot t,
    each reading the mask token and fc(mask_hidden), never the previous draft; the unroll must
    give what that one forward gives (vLLM's parallel_drafting)."""
    drafter = drafter_for(target, "eagle3", parallel_drafting=True).eval()
    cfg = drafter.cfg
    assert cfg.mask_token_id == VOCAB - 1 and drafter.mask_hidden.shape == (cfg.fc_in_features,)
    (s,) = samples_for(target, "eagle3", [9], aux_ids=cfg.aux_layer_ids)
    b = pack([s], 8)
    ids, hid, pos = b["input_ids"], b["hidden"], b.position_ids
    outs = drafter.unroll(ids, hid, pos, b.seq_ids, num_steps=3)
    with torch.no_grad():
        out0, _, kv0 = drafter.step(ids, drafter.fc(hid), pos)
        torch.testing.assert_close(outs[0][0], out0)
        g_mask = drafter.fc(drafter.mask_hidden)
        for t in range(6):
            # One forward over two mask slots at positions t+1, t+2 behind the step-0 cache of 0..t.
            past = [tuple(x[:, :, : t + 1] for x in kv0)]
            mask_ids = torch.full((1, 2), cfg.mask_token_id)
            causal = torch.ones(2, t + 3, dtype=torch.bool).tril(t + 1)[None]
            out, _, _ = drafter.step(mask_ids, g_mask.expand(1, 2, -1), pos[:, t: t + 1] + torch.tensor([[1, 2]]),
                                     causal, None, past)
            for j in (1, 2):
                torch.testing.assert_close(outs[j][0][:, t], out[:, j - 1], atol=1e-5, rtol=1e-5)
    # The later steps read no draft: changing the tokens after t leaves them alone.
    other = ids.clone()
    other[:, 4:] = (other[:, 4:] + 1) % VOCAB
    with torch.no_grad():
        changed = drafter.unroll(other, hid, pos, b.seq_ids, num_steps=3)
    torch.testing.assert_close(changed[2][0][:, 2], outs[2][0][:, 2])


def test_parallel_drafting_config_export_and_round_trip(target, tmp_path):
    with pytest.raises(ValueError, match="parallel_drafting: only for kind='eagle3'"):
        DrafterConfig.from_target(target.config, kind="eagle", parallel_drafting=True)
    with pytest.raises(ValueError, match="mask_token_id=320"):
        DrafterConfig.from_target(target.config, kind="eagle3", parallel_drafting=True).replace(mask_token_id=VOCAB)
    drafter = drafter_for(target, "eagle3", parallel_drafting=True)
    folder = export_drafter(drafter, tmp_path / "p")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["mask_token_id"] == VOCAB - 1 and cfg["tlt_drafter"]["parallel_drafting"] is True
    assert load_file(str(folder / "model.safetensors"))["mask_hidden"].shape == (192,)
    loaded = load_drafter(folder, target.config, *target_tensors(target))
    assert loaded.cfg.parallel_drafting and torch.equal(loaded.mask_hidden, drafter.mask_hidden)
    assert _same_outputs(drafter, loaded, target, "eagle3")
    # The engine config TLT builds for the folder serves it with parallel drafting (a sequential
    # engine would draft with a drafter trained for mask slots); a sequential folder without it.
    from tlt_verl.rollout.config import drafter_speculative_config

    assert drafter_speculative_config(str(folder), "eagle3", 3)["parallel_drafting"] is True
    seq = export_drafter(drafter_for(target, "eagle3"), tmp_path / "seq")
    assert "parallel_drafting" not in drafter_speculative_config(str(seq), "eagle3", 3)


def test_eagle3_multi_step_loss_decreases_on_tiny_overfit():
    # A random target at the usual init is almost uniform (the loss floor, its entropy, is then
    # ~log V); a wider init gives it a peaked next-token distribution worth fitting.
    torch.manual_seed(0)
    target = Qwen2ForCausalLM(qwen2_config(initializer_range=0.3)).eval()
    drafter = drafter_for(target, "eagle3", draft_vocab_size=200)
    counts = torch.bincount(torch.randint(0, VOCAB, (2000,), generator=torch.Generator().manual_seed(3)),
                            minlength=VOCAB)
    drafter.set_draft_vocab(counts)
    assert int(drafter.t2d.sum()) == 200 and drafter.d2t.dtype == torch.int64
    assert torch.equal(torch.nonzero(drafter.t2d).flatten(), drafter.draft_to_target)
    batch = pack(samples_for(target, "eagle3", [14, 11], aux_ids=drafter.cfg.aux_layer_ids), 26)
    cfg = LossConfig(eagle3_steps=3)
    opt = torch.optim.Adam(drafter.trainable_parameters(), lr=3e-3)
    history = []
    for _ in range(25):
        loss, metrics = drafter_loss(drafter, batch, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(metrics)
    assert set(history[0]) >= {"step0_loss", "step1_loss", "step2_loss"}
    for j in range(3):
        assert history[-1][f"step{j}_loss"] < 0.7 * history[0][f"step{j}_loss"], (j, history[0], history[-1])


def test_eagle_overfits_hidden_and_token_losses():
    torch.manual_seed(0)
    target = Qwen2ForCausalLM(qwen2_config(initializer_range=0.3)).eval()
    drafter = drafter_for(target, "eagle")
    batch = pack(samples_for(target, "eagle", [14, 11]), 26)
    opt = torch.optim.Adam(drafter.trainable_parameters(), lr=3e-3)
    history = []
    for _ in range(25):
        loss, metrics = drafter_loss(drafter, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(metrics)
    assert history[0]["tokens"] == 11 + 8          # slots whose input token is a response token
    for key in ("hidden_loss", "prob_loss"):
        assert history[-1][key] < 0.7 * history[0][key], (key, history[0], history[-1])


def test_attention_matches_hf_llama_attention():
    """Rotary convention, GQA and scaling as HF Llama (and so vLLM's Llama layer) compute them."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from tlt_verl.drafter.layers import Attention

    cfg = DrafterConfig.from_target(qwen2_config(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))
    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ours, theirs = Attention(cfg, 64), LlamaAttention(hf_cfg, layer_idx=0)
    theirs.load_state_dict(ours.state_dict())
    x, pos = torch.randn(1, 9, 64), torch.arange(3, 12)[None]
    causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    want, _ = theirs(x, LlamaRotaryEmbedding(hf_cfg)(x, pos), attention_mask=causal)
    got, _ = ours(x, pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_masked_attention_is_the_same_dense_or_in_chunks():
    """A packed row (samples of uneven lengths, grouped-query heads), its mask given whole or as
    the packed rows' BlockCausal, with and without the unroll's diagonal key blocks: one dense
    call (CUDA's path, its kv heads expanded for the memory-efficient kernel) and per-chunk key
    selection (the CPU's) give the same output and gradients."""
    from bench.gpu_drafter_attention import packed_row
    from tlt_verl.drafter.layers import MASK_CHUNK, masked_attention

    torch.manual_seed(0)
    S, seq_ids, mask = packed_row()
    assert S > 3 * MASK_CHUNK
    for diagonal in (0, 2):
        layout = BlockCausal(seq_ids, diagonal)
        whole = layout.dense()
        assert whole.shape == (1, S, (1 + diagonal) * S)
        if diagonal == 0:
            assert torch.equal(whole, mask)
        q, k, v = (torch.randn(1, h, n, 16, requires_grad=True) for h, n in ((4, S), (2, whole.shape[-1]),
                                                                               (2, whole.shape[-1])))
        results = []
        for m, dense in ((whole, True), (whole, False), (layout, False), (layout, True)):
            out = masked_attention(q, k, v, m, dense)
            grads = torch.autograd.grad((out * torch.linspace(-1, 1, S)[:, None]).sum(), (q, k, v))
            results.append((out, *grads))
        for other in results[1:]:
            for a, b in zip(results[0], other):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # The expanded heads are the grouped ones: query heads 0-1 read kv head 0, heads 2-3 kv head 1.
    q, k, v = (torch.randn(1, h, S, 16) for h in (4, 2, 2))
    one_head = masked_attention(q[:, 2:3], k[:, 1:2], v[:, 1:2], mask, True)
    torch.testing.assert_close(masked_attention(q, k, v, mask, True)[:, 2:3], one_head, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- checkpoint folders

VLLM_EAGLE_NAMES = {"fc.weight", "layers.0.post_attention_layernorm.weight",
                    *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


def _same_outputs(a, b, target, kind):
    (s,) = samples_for(target, kind, [10], aux_ids=a.cfg.aux_layer_ids)
    bt = pack([s], 10)
    args = (bt["input_ids"], bt["hidden"], bt.position_ids)
    with torch.no_grad():
        return torch.equal(a(*args), b(*args))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_eagle_export_layout_and_round_trip(target, tmp_path, engine):
    drafter = drafter_for(target, "eagle")
    folder = export_drafter(drafter, tmp_path / engine, engine=engine)
    cfg = json.loads((folder / "config.json").read_text())
    arch = {"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}[engine]
    assert cfg["architectures"] == [arch] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"],
            cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (1, 64, VOCAB, 4, 2)
    weights = load_file(str(folder / "model.safetensors"))
    expected = VLLM_EAGLE_NAMES | ({"fc.bias"} if engine == "sglang" else set())
    assert set(weights) == expected
    assert weights["fc.weight"].shape == (64, 128)
    if engine == "sglang":
        assert not weights["fc.bias"].any()
    loaded = load_drafter(folder, target.config, *target_tensors(target))
    assert _same_outputs(drafter, loaded, target, "eagle")


def test_eagle3_export_layout_and_round_trip(target, tmp_path):
    drafter = drafter_for(target, "eagle3", draft_vocab_size=100)
    drafter.set_draft_vocab(torch.arange(VOCAB).flip(0).float())     # low ids most frequent
    folder = export_drafter(drafter, tmp_path / "e3")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["norm_before_residual"]) == (100, 64, False)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    w = load_file(str(folder / "model.safetensors"))
    assert w["fc.weight"].shape == (64, 192) and w["layers.0.self_attn.q_proj.weight"].shape == (64, 128)
    assert w["lm_head.weight"].shape == (100, 64) and w["d2t"].dtype == torch.int64
    assert {"norm.weight", "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight", "t2d"} <= set(w)
    assert not any("embed" in k for k in w)
    loaded = load_drafter(folder, target.config, *target_tensors(target))
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    assert _same_outputs(drafter, loaded, target, "eagle3")
    # Full vocabulary: no maps written (vLLM would have nothing to load them into).
    full = export_drafter(drafter_for(target, "eagle3"), tmp_path / "full")
    assert not {"d2t", "t2d"} & set(load_file(str(full / "model.safetensors")))
    load_drafter(full, target.config, *target_tensors(target))


def test_load_refuses_mismatched_drafters(target, tmp_path):
    folder = export_drafter(drafter_for(target, "eagle3"), tmp_path / "d")
    tensors = target_tensors(target)
    cases = [
        (qwen2_config(vocab_size=512), r"vocab_size=320 does not match the target's vocab_size=512$"),
        (qwen2_config(hidden_size=128), r"hidden_size=64 does not match the target's hidden_size=128$"),
        (qwen2_config(num_hidden_layers=2), r"eagle_aux_hidden_state_layer_ids=\[0, 2, 3\] out of range for a target with 2 layers$"),
    ]
    for tc, msg in cases:
        with pytest.raises(ValueError, match=msg) as err:
            load_drafter(folder, tc, *tensors)
        assert "\n" not in str(err.value)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(ValueError, match=r"architecture 'Qwen2ForCausalLM' is not an EAGLE drafter"):
        load_drafter(folder, target.config, *tensors)
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"num_hidden_layers=2, only one-layer drafters"):
        load_drafter(folder, target.config, *tensors)
    # Weights that do not fit the config are named, not half-loaded.
    (folder / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(folder / "model.safetensors"))
    w.pop("norm.weight")
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"weights do not fit a eagle3 drafter: missing norm.weight$"):
        load_drafter(folder, target.config, *tensors)


def test_warm_start_from_a_public_style_eagle_folder(target, tmp_path):
    """EAGLE's own folders: ``model.``/``midlayer.`` names, a copy of the embedding, a trained
    fc bias, pytorch_model.bin."""
    src = drafter_for(target, "eagle")
    folder = export_drafter(src, tmp_path / "src", engine="sglang")
    w = {("model." + k): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    w["model.fc.bias"] = torch.full((64,), 0.1)
    w["model.embed_tokens.weight"] = torch.zeros(VOCAB, 64)
    (folder / "model.safetensors").unlink()
    torch.save(w, folder / "pytorch_model.bin")
    tensors = target_tensors(target)
    with pytest.raises(ValueError, match=r"fc.bias is nonzero .* warm_start=True"):
        load_drafter(folder, target.config, *tensors)
    with pytest.warns(UserWarning, match="dropping a nonzero fc.bias"):
        warm = load_drafter(folder, target.config, *tensors, warm_start=True)
    assert torch.equal(warm.fc.weight, src.fc.weight)
    assert warm.target.embed_weight.data_ptr() == tensors[0].data_ptr()

    e3 = drafter_for(target, "eagle3")
    folder3 = export_drafter(e3, tmp_path / "e3")
    w3 = {k.replace("layers.0.", "midlayer."): v for k, v in load_file(str(folder3 / "model.safetensors")).items()}
    w3.pop("lm_head.weight")                         # some EAGLE-3 folders share the target's head
    save_file(w3, str(folder3 / "model.safetensors"))
    warm3 = load_drafter(folder3, target.config, *tensors, warm_start=True)
    assert torch.equal(warm3.layers[0].hidden_norm.weight, e3.layers[0].hidden_norm.weight)
    assert torch.equal(warm3.lm_head.weight, tensors[1])


def test_device_defaults_pick_the_gpu_kernels_only_where_they_run(target, monkeypatch):
    import sys
    import types

    from tlt_verl.drafter.config import resolve_attention
    from tlt_verl.drafter.trainer import TrainerConfig, autocast_bf16

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_attention("auto", cpu, "eagle") == "sdpa"
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    assert resolve_attention("auto", cuda, "eagle") == "flash_varlen"
    assert resolve_attention("auto", cuda, "eagle3") == "sdpa"        # unrolled steps need a dense mask
    assert resolve_attention("sdpa", cuda, "eagle") == "sdpa"         # an explicit choice stands
    monkeypatch.setitem(sys.modules, "flash_attn", None)              # not installed
    assert resolve_attention("auto", cuda, "eagle") == "sdpa"
    assert autocast_bf16("auto", cuda) and not autocast_bf16("auto", cpu) and autocast_bf16("bf16", cpu)
    with pytest.raises(ValueError, match="precision='fp16'"):
        TrainerConfig(precision="fp16")
    # "auto" on CPU is the SDPA path: the same loss as asking for it.
    drafter = drafter_for(target, "eagle")
    batch = pack(samples_for(target, "eagle", [6, 5]), 12)
    auto, _ = drafter_loss(drafter, batch, LossConfig())
    sdpa, _ = drafter_loss(drafter, batch, LossConfig(attention="sdpa"))
    assert torch.equal(auto, sdpa)


def test_bf16_autocast_trains_with_fp32_master_weights(target):
    from _drafters import captured_records

    from tlt_verl.capture.buffer import BufferConfig, DataBuffer
    from tlt_verl.drafter.trainer import DrafterTrainer, TrainerConfig

    buffer = DataBuffer(BufferConfig(kind="eagle"))
    for r in captured_records(target, 8, VOCAB, seed=0, lengths=(10, 20)):
        buffer.add(1, r["input_ids"], r["loss_mask"], r["final_hidden"], r["aux_hidden"])
    drafter = drafter_for(target, "eagle")
    seen = []
    drafter.fc.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    trainer = DrafterTrainer(drafter, buffer, TrainerConfig(precision="bf16", tokens_per_micro=48, row_len=48,
                                                            warmup_steps=0, lr=1e-2))
    history = trainer.train(max_steps=30).history
    assert seen[0] == torch.bfloat16 and all(p.dtype == torch.float32 for p in trainer.params)
    assert history[-1]["loss"] < history[0]["loss"]
