"""The GPU recipes' memory tables (tlt_verl/launch/memory_plan.py): each recipe's block is what
its own settings give, each phase fits the card with the headroom the block states, and the plan's
inputs agree with the code and configs they stand for. Arithmetic: no verl or vLLM import, no GPU
(torch only to count the drafter modules' parameters)."""
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tlt_verl.launch import memory_plan as mp

REPO = Path(__file__).resolve().parents[1]
RECIPES = ["qwen2.5_7b_grpo_8gpu.sh", "qwen2.5_32b_grpo_multinode.sh"]


def test_parameter_counts_from_the_shapes_match_the_published_totals():
    assert 7.60e9 < mp.MODELS["Qwen2.5-7B"].params < 7.63e9          # 7.62B
    assert 32.7e9 < mp.MODELS["Qwen2.5-32B"].params < 32.8e9         # 32.76B (HF: 32.8B)


def test_a_shape_read_from_config_json_is_the_tables_own():
    # Qwen2.5-7B's config.json (the fields the shape reads).
    cfg = {"hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
    m = mp.ModelShape.from_hf_config(cfg, "Qwen2.5-7B")
    assert m == mp.MODELS["Qwen2.5-7B"]
    # 2 (K, V) x 28 layers x 4 KV heads x 128 x bf16; a drafter layer more; 4 KV heads over TP 8: one each.
    assert m.kv_bytes_per_token(2) == 57344 and m.kv_bytes_per_token(2, extra_layers=1) == 59392
    assert m.kv_bytes_per_token(2, tp=8) == 2 * 28 * 1 * 128 * 2
    # A config that states head_dim (SmolLM3, Gemma) is read as stated.
    assert mp.ModelShape.from_hf_config({**cfg, "head_dim": 64}).head_dim == 64


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recipes_table_is_what_its_settings_give_and_fits(recipe):
    path = REPO / "recipes" / recipe
    p = mp.plan(mp.read_recipe(path))
    written = mp.block_of(path.read_text())
    assert written is not None, f"{recipe}: no memory plan block; run python -m tlt_verl.launch.memory_plan --write"
    assert written == mp.render(p), (f"{recipe}: its memory table is stale; regenerate it with "
                                     f"python -m tlt_verl.launch.memory_plan --write recipes/{recipe}")
    assert p.errors == []
    # The headroom the block writes down, and that each phase keeps at least that.
    required = float(re.search(r"required >= ([\d.]+)", "\n".join(written)).group(1)) * mp.GiB
    for phase in ("training", "rollout"):
        assert p.total(phase) + p.headroom(phase) == p.recipe.card.total
        assert p.headroom(phase) >= required, phase


def _edited(tmp_path, recipe: str, old: str, new: str) -> Path:
    text = (REPO / "recipes" / recipe).read_text()
    assert old in text
    out = tmp_path / recipe
    out.write_text(text.replace(old, new))
    return out


@pytest.mark.parametrize("old, new", [
    ("gpu_memory_utilization=0.6", "gpu_memory_utilization=0.65"),
    ("tensor_model_parallel_size=2", "tensor_model_parallel_size=4"),
    ("ppo_max_token_len_per_gpu=24576", "ppo_max_token_len_per_gpu=32768"),
    ("actor.strategy=fsdp2", "actor.strategy=fsdp2\n  actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"),
])
def test_a_setting_changed_without_regenerating_is_caught(tmp_path, old, new):
    path = _edited(tmp_path, RECIPES[0], old, new.replace("\n", " \\\n"))
    assert mp.block_of(path.read_text()) != mp.render(mp.plan(mp.read_recipe(path)))


def test_the_32b_recipe_needs_its_sequence_parallelism_and_offload_gives_its_margin(tmp_path):
    recipe = RECIPES[1]
    with_offload = mp.plan(mp.read_recipe(REPO / "recipes" / recipe))
    text = (REPO / "recipes" / recipe).read_text()
    no_offload = tmp_path / recipe
    no_offload.write_text(text.replace("_offload=True", "_offload=False"))
    # Without the actor's offload its fp32 shards sit beside vLLM in the rollout: the phase keeps
    # barely the required headroom (the recipe's comment), against three times that with it.
    bare = mp.plan(mp.read_recipe(no_offload))
    assert bare.headroom("rollout") < with_offload.headroom("rollout") - 8 * mp.GiB
    r = mp.read_recipe(REPO / "recipes" / recipe)
    no_sp = replace(r, settings=replace(r.settings, sequence_parallel=1, ref_sequence_parallel=1))
    assert any("ppo_max_token_len_per_gpu=16384 x sequence parallel 1 < the longest sequence 21504" in e
               for e in mp.plan(no_sp).errors)


def test_overrides_the_plan_does_not_model_are_refused(tmp_path):
    path = _edited(tmp_path, RECIPES[0], "actor.strategy=fsdp2",
                   "actor.strategy=fsdp2 \\\n  actor_rollout_ref.model.enable_activation_offload=True")
    with pytest.raises(ValueError, match="enable_activation_offload: the memory plan does not model"):
        mp.read_recipe(path)


def test_env_defaults_fill_the_overrides():
    overrides = mp.parse_overrides((REPO / "recipes" / RECIPES[1]).read_text())
    assert overrides["trainer.nnodes"] == "4" and overrides["actor_rollout_ref.model.path"] == "$MODEL"


def test_the_plans_defaults_are_verls():
    """Settings' defaults stand for what verl 0.9.1 composes when a recipe leaves a key out."""
    from importlib.util import find_spec

    verl = Path(find_spec("verl").origin).parent       # located, not imported (importing verl takes seconds)
    config = yaml.safe_load((verl / "trainer/config/_generated_ppo_trainer.yaml").read_text())
    defaults = mp.Settings()
    for key, (name, conv) in mp.MODELED.items():
        node = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if key.startswith("+") or not isinstance(node, (bool, int, float)):
            continue          # TLT's keys, and verl's that follow another key (set in settings_from)
        assert conv(str(node)) == getattr(defaults, name), key
    # TLT's: recipes/tlt.yaml is the `tlt:` block at the dataclasses' defaults (tests/test_bad_input.py).
    tlt = yaml.safe_load((REPO / "recipes" / "tlt.yaml").read_text())["tlt"]
    assert tlt["drafter"]["kind"] is None and defaults.drafter_kind == "eagle"      # scratch: eagle
    assert tlt["drafter"]["trainer"]["tokens_per_micro"] == defaults.drafter_tokens_per_micro
    assert tlt["drafter"]["buffer"]["budget_bytes"] == defaults.drafter_buffer_bytes
    assert max(tlt["sd"]["bandit"]["arms"]) == defaults.sd_max_k and tlt["spot"]["train_drafter"] == "auto"


def test_the_drafter_terms_follow_the_drafter_code():
    """drafter_params against the real drafter modules, at small shapes whose every width differs
    (the count is a polynomial in them; the meta device would cost a torch._dynamo import), and
    the dtype the drafter process reads the target's embedding and LM head in."""

    import torch

    from tlt_verl.drafter import DrafterConfig, build_drafter, default_aux_layer_ids
    from tlt_verl.drafter.target_weights import rollout_dtype

    for m in (mp.ModelShape("a", hidden=64, layers=9, intermediate=96, heads=4, kv_heads=2, vocab=101),
              mp.ModelShape("b", hidden=48, layers=12, intermediate=136, heads=6, kv_heads=1, vocab=77)):
        for kind in ("eagle", "eagle3"):
            cfg = DrafterConfig(kind=kind, hidden_size=m.hidden, num_attention_heads=m.heads,
                                num_key_value_heads=m.kv_heads, head_dim=m.head_dim, intermediate_size=m.intermediate,
                                vocab_size=m.vocab, target_num_layers=m.layers, target_hidden_size=m.hidden,
                                aux_layer_ids=default_aux_layer_ids(m.layers) if kind == "eagle3" else ())
            target = torch.zeros(m.vocab, m.hidden)
            drafter = build_drafter(cfg, target, target)
            assert sum(p.numel() for p in drafter.parameters()) == mp.drafter_params(m, kind), (m.name, kind)
    assert len(default_aux_layer_ids(28)) == len(default_aux_layer_ids(64)) == mp.DrafterSpec().eagle3_aux
    # The plan holds the target's embedding and LM head in the recipe's rollout dtype, as the
    # drafter does (target_weights.rollout_dtype of what the actor worker passes: rollout.dtype).
    assert mp.DrafterSpec().embed_head_bytes is None and mp.DrafterSpec().embed_head_copies == 1
    assert rollout_dtype("bfloat16").itemsize == mp.Settings().rollout_dtype_bytes
