"""Warm starts from the target (``drafter.init_from_target``: layers | specforge, ``drafter.init_copy_layers``) are
what they claim on a tiny target: copied layers, the identity projection on the feature that feeds them, the target's
norms, and heads that correct nothing at step 0; and the schedule choice ``train.lr_schedule``."""

import pytest
import torch

from dartree.models.target import tiny_target
from dartree.training.build import build_models
from dartree.training.recipe import RecipeError, load_recipe
from dartree.training.schedule import WarmupCosine
from dartree.training.settings import model_settings

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "input_layernorm",
        "post_attention_layernorm", "q_norm", "k_norm")


def _src(layer, name):
    return getattr(layer.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
                   else layer.mlp if name in ("gate_proj", "up_proj", "down_proj") else layer, name).weight


@pytest.fixture(scope="module")
def target():
    """A tiny target (6 layers) whose norms are not all ones, so a copied norm is told from a fresh one."""
    t = tiny_target(num_layers=6)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in t.model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return t


def _build(target, recipe, *words):
    cfg = load_recipe([f"recipe={recipe}", "drafter.num_layers=2", *words])
    torch.manual_seed(0)
    return build_models(model_settings(cfg), target)


@pytest.mark.parametrize("recipe", ["tiny_dflash", "tiny_domino", "tiny_dspark", "tiny_dflash2"])
def test_specforge_warm_start_copies_layers_identity_projection_and_norms(target, recipe):
    drafter, head = _build(target, recipe, "drafter.init_from_target=specforge")
    n = len(target.model.model.layers)
    ids = drafter.cfg.target_layer_ids
    assert ids == [1, n - 3]  # the DFlash rule for 2 features on 6 layers
    for mine, idx in zip(drafter.layers, (n - 2, n - 1)):  # the target's top 2 layers, in order
        for name in PROJ:
            if hasattr(mine, name):
                torch.testing.assert_close(getattr(mine, name).weight, _src(target.model.model.layers[idx], name),
                                           rtol=0, atol=0)
    d = drafter.cfg.hidden_size
    want = torch.zeros(d, len(ids) * d)
    want[:, d:] = torch.eye(d)  # identity on layer n-3's output: the input of the first copied layer n-2
    torch.testing.assert_close(drafter.fc.weight, want, rtol=0, atol=0)
    torch.testing.assert_close(drafter.hidden_norm.weight, target.model.model.layers[n - 2].input_layernorm.weight)
    torch.testing.assert_close(drafter.norm.weight, target.model.model.norm.weight)
    # the first copied layer's context K/V are the target's own at layer n-2: k_proj(input_layernorm(h_{n-3}))
    h = torch.randn(3, d)
    feats = torch.cat([torch.randn(3, d), h], -1)
    ctx = drafter.hidden_norm(drafter.fc(feats))
    torch.testing.assert_close(ctx, target.model.model.layers[n - 2].input_layernorm(h))
    # the head corrects nothing at step 0: g(C, H, r) equals the base scores
    g = torch.Generator().manual_seed(1)
    cand = torch.randint(2, target.vocab_size, (4, 5), generator=g)
    hidden, base = torch.randn(4, d, generator=g), torch.randn(4, 5, generator=g)
    state = head.init_state(torch.randint(2, target.vocab_size, (4,), generator=g))
    torch.testing.assert_close(head.score(cand, hidden, state, base), base, rtol=0, atol=0)
    if getattr(head, "confidence_head", False):  # SpecForge's confidence head starts at zero
        assert not head.confidence.weight.any() and not head.confidence.bias.any()


def test_layers_warm_start_copies_layers_only_and_a_count_of_them(target):
    drafter, _ = _build(target, "tiny_dspark", "drafter.init_from_target=layers")
    fresh, _ = _build(target, "tiny_dspark", "drafter.init_from_target=false")
    n = len(target.model.model.layers)
    torch.testing.assert_close(drafter.layers[1].q_proj.weight, _src(target.model.model.layers[n - 1], "q_proj"))
    torch.testing.assert_close(drafter.fc.weight, fresh.fc.weight)  # random, as without a warm start
    assert torch.equal(drafter.norm.weight, torch.ones_like(drafter.norm.weight))
    # true is the same as layers (recipes written before the variants)
    same, _ = _build(target, "tiny_dspark", "drafter.init_from_target=true")
    for a, b in zip(drafter.state_dict().values(), same.state_dict().values()):
        assert torch.equal(a, b)
    # one copied layer into a 2-layer drafter: layer 0 is the target's top layer, layer 1 keeps its random weights
    one, _ = _build(target, "tiny_dspark", "drafter.init_from_target=specforge", "drafter.init_copy_layers=1")
    torch.testing.assert_close(one.layers[0].q_proj.weight, _src(target.model.model.layers[n - 1], "q_proj"))
    torch.testing.assert_close(one.layers[1].q_proj.weight, fresh.layers[1].q_proj.weight)
    torch.testing.assert_close(one.hidden_norm.weight, target.model.model.layers[n - 1].input_layernorm.weight)
    d = one.cfg.hidden_size  # layer n-2's output is not captured ([1, n-3]): the identity is on the last feature
    assert torch.equal(one.fc.weight[:, d:], torch.eye(d)) and not one.fc.weight[:, :d].any()


def test_warm_start_recipe_values_are_checked(target):
    with pytest.raises(RecipeError, match=r"^drafter.init_from_target='copy' is not allowed: use one of"):
        load_recipe(["recipe=tiny_dspark", "drafter.init_from_target=copy"])
    with pytest.raises(RecipeError, match="^drafter.init_copy_layers=1 copies layers only with a warm start"):
        load_recipe(["recipe=tiny_dspark", "drafter.init_copy_layers=1"])
    with pytest.raises(RecipeError, match="drafter.init_copy_layers=-1"):
        load_recipe(["recipe=tiny_dspark", "drafter.init_copy_layers=-1"])
    with pytest.raises(RecipeError, match="drafter.init_copy_layers=3 exceeds drafter.num_layers=2"):
        _build(target, "tiny_dspark", "drafter.init_from_target=specforge", "drafter.init_copy_layers=3")
    with pytest.raises(RecipeError, match="copy_layers=3 must be in"):  # built in Python, past the recipe checks
        cfg = load_recipe(["recipe=tiny_dspark", "drafter.num_layers=3", "drafter.init_from_target=specforge",
                           "drafter.init_copy_layers=3"])
        cfg.drafter.num_layers = 2
        build_models(model_settings(cfg), target)


def test_constant_schedule_holds_the_rate_after_the_warm_up():
    const = WarmupCosine(warm=2, total=10, cap_s=0, constant=True)
    cos = WarmupCosine(warm=2, total=10, cap_s=0)
    assert [const(s) for s in (0, 1)] == [cos(s) for s in (0, 1)] == [0.5, 1.0]
    assert [const(s) for s in (2, 5, 9, 20)] == [1.0, 1.0, 1.0, 1.0]
    assert cos(9) < 0.1
    cfg = load_recipe(["recipe=tiny_dspark", "train.lr_schedule=constant"])
    assert cfg.train.lr_schedule == "constant"
    with pytest.raises(RecipeError, match="train.lr_schedule='linear' is not allowed"):
        load_recipe(["recipe=tiny_dspark", "train.lr_schedule=linear"])
