"""A drafter family added in one file (this one): a toy head, its recipe defaults and its loss register under a name,
and the unchanged training, checkpoint, conversion and decoding code serve it (docs/families.md).

The toy head ("tanh bigram"): g(C, H, r) = U[C] + s W2[C] · tanh(W1[x_prev] + P h), state r = W1[x_prev] [N, R] (a
function of the previous token alone, so ``first_order``), s a hyper-parameter. Its family ("toy") adds the recipe key
``head.toy_scale`` (s, default 1.0) and trains the head with CE of the corrected logits plus 0.5 KL(p_t || p_d) to the
target's distribution. Nothing outside this file names either.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from conftest import VOCAB
from dartree.models.families import FAMILIES, Family, Objective, get_family, register_family
from dartree.models.heads import HEADS, CorrectionHead
from dartree.base.fields import Range, check_fields
from dartree.decode.settings import DecodeSettings
from dartree.training.recipe import RecipeError, load_recipe
from dartree.training.trainer import run


class TanhBigramHead(CorrectionHead):
    """g(C, H, r) = U[C] + s W2[C] · tanh(W1[x_prev] + P h): ``w1`` [V, R], ``w2`` [V, R] (zero at start: an untrained
    head is the identity), ``proj`` [R, D], s = ``scale``. State r = W1[x_prev] [N, R] fp32."""

    type_name = "toy_tanh"
    first_order = True
    fields = {"vocab_size": Range(1), "rank": Range(1), "hidden_size": Range(1),
              "scale": Range(0, integer=False, lo_open=True)}

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, scale: float = 1.0):
        super().__init__()
        check_fields({"vocab_size": vocab_size, "rank": rank, "hidden_size": hidden_size, "scale": scale},
                     self.fields, "toy_tanh head: ")
        self.vocab_size, self.rank, self.hidden_size, self.scale = vocab_size, rank, hidden_size, float(scale)
        self.w1 = nn.Embedding(vocab_size, rank)
        self.w2 = nn.Linear(rank, vocab_size, bias=False)
        self.proj = nn.Linear(hidden_size, rank, bias=False)
        nn.init.zeros_(self.w2.weight)

    def hparams(self):
        return {"vocab_size": self.vocab_size, "rank": self.rank, "hidden_size": self.hidden_size, "scale": self.scale}

    def init_state(self, anchor_ids):
        return self.w1(anchor_ids).float()

    def advance(self, state, tokens, hidden=None):
        return self.w1(tokens).float()

    def factors(self, hidden, state):
        return self.scale * torch.tanh(state.float() + F.linear(hidden.float(), self.proj.weight.float()))

    def out_rows(self, cand):
        return self.w2.weight[cand].float()

    def score(self, cand, hidden, state, base):
        return base.float() + torch.einsum("nkr,nr->nk", self.out_rows(cand), self.factors(hidden, state))

    def block_states(self, prev_ids, hidden):
        return self.w1(prev_ids).float()

    def block_factors(self, prev_ids, hidden, vocab=None):
        w2 = self.w2.weight if vocab is None else self.w2.weight[vocab]
        a = self.scale * torch.tanh(self.w1(prev_ids).float() + F.linear(hidden.float(), self.proj.weight.float()))
        return a, w2.float()


class ToyFamily(Family):
    """The toy family: :class:`TanhBigramHead` of rank ``head.rank`` and scale ``head.toy_scale`` (its own recipe
    key), loss CE + 0.5 KL(p_t || p_d)."""

    name = "toy"
    heads = (TanhBigramHead,)
    recipe_fields = {"toy_scale": (1.0, Range(0, integer=False, lo_open=True, note="the toy head's scale s"))}

    def head_kwargs(self, head, vocab_size, hidden_size):
        return {"vocab_size": vocab_size, "rank": head["rank"], "hidden_size": hidden_size,
                "scale": head["toy_scale"]}

    def objective(self, loss, head):
        return Objective(gamma=loss["gamma"], ce_weight=1.0, kl_weight=0.5, logged=("kl",))


@pytest.fixture
def toy_family():
    """The toy family registered for one test, and removed again (so other tests see the built-in registry)."""
    fam = register_family(ToyFamily())
    yield fam
    del FAMILIES["toy"], HEADS["toy_tanh"]


TOY = ["recipe=tiny_dflash", "loss.type=toy", "head.type=toy_tanh", "head.rank=8", "train.max_steps=4",
       "train.engine=torch"]


def test_the_registry_refuses_a_second_toy_and_names_the_families(toy_family):
    with pytest.raises(ValueError, match="drafter family 'toy' is already registered"):
        register_family(ToyFamily())
    with pytest.raises(KeyError, match=r"unknown drafter family \(loss.type\) 'nope'; available: \['dflash', "
                                       r"'dflash2', 'domino', 'dspark', 'dspine', 'toy'\]"):
        get_family("nope")
    with pytest.raises(RecipeError, match=r"loss.type 'toy' trains head.type \['toy_tanh'\], not 'markov'"):
        load_recipe([*TOY, "head.type=markov"])
    with pytest.raises(RecipeError, match="loss.tv_weight=0.3 apply to loss.type=dspark(/dspine)? only"):
        load_recipe([*TOY, "loss.tv_weight=0.3"])  # the toy's KL is its own, not the recipe's DSpark weights
    with pytest.raises(RecipeError, match=r"^head.toy_scale=-1 is out of range: must be a finite number > 0 "
                                          r"\(the toy head's scale s\)$"):
        load_recipe([*TOY, "head.toy_scale=-1"])
    assert load_recipe(TOY).head.toy_scale == 1.0 and load_recipe([*TOY, "head.toy_scale=0.5"]).head.toy_scale == 0.5
    assert load_recipe(["recipe=tiny_dspark"]).head.toy_scale == 1.0  # every recipe holds the registered keys


def test_the_toy_family_is_refused_before_it_registers():
    with pytest.raises(RecipeError, match=r"head.type 'toy_tanh' is unknown; available: \['dspine', 'gated_markov', 'gru', "):
        load_recipe(TOY)
    with pytest.raises(RecipeError, match=r"unknown key 'head.toy_scale' in command line; valid keys there: "):
        load_recipe(["recipe=tiny_dflash", "head.toy_scale=0.5"])


@pytest.mark.slow  # trains end to end
def test_a_family_in_one_file_trains_saves_converts_and_decodes_losslessly(toy_family, tmp_path, monkeypatch,
                                                                           prompts):
    from dartree.convert.importer import convert
    from dartree.decode.generate import autoregressive_generate, speculative_generate
    from dartree.models.checkpoint import load_dartree
    from dartree.models.target import load_target

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    summary = run(load_recipe([*TOY, "head.toy_scale=0.5", f"output_dir={tmp_path / 'run'}"]))
    losses = summary["losses"]
    # CE + 0.5 KL over 96 tokens from an untrained drafter: the CE alone is about ln 96 = 4.56 nats
    assert len(losses) == 4 and all(4.0 < x < 8.0 for x in losses)
    config = json.loads((tmp_path / "run" / "checkpoint" / "config.json").read_text())
    assert config["head"] == {"type": "toy_tanh", "vocab_size": VOCAB, "rank": 8, "hidden_size": 32, "scale": 0.5}
    dm = load_dartree(tmp_path / "run" / "checkpoint")
    assert isinstance(dm.head, TanhBigramHead) and float(dm.head.w2.weight.detach().abs().sum()) > 0  # trained from 0

    target = load_target("tiny-qwen3")  # the recipe's target
    out = convert(tmp_path / "run" / "checkpoint", tmp_path / "dt")  # the training checkpoint, in bf16
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("head.w2.weight").get_dtype() == "BF16" and f.get_slice("head.w2.weight").get_shape() == [
            VOCAB, 8]
    dm = load_dartree(out, target=target)
    assert dm.config["head"]["type"] == "toy_tanh" and dm.head.w2.weight.dtype == torch.float32  # the target's dtype
    target.set_layer_ids(dm.drafter.cfg.target_layer_ids)
    with torch.no_grad():  # the head's correction acts on the decoded scores (w2 trained, tanh(...) non-zero)
        corr = dm.head.score(torch.arange(VOCAB)[None], torch.randn(1, 32), dm.head.init_state(torch.tensor([5])),
                             torch.zeros(1, VOCAB))
    assert float(corr.abs().max()) > 0
    for builder in ("pruned", "chain"):
        for p in prompts[:3]:
            want = autoregressive_generate(target, p, max_new_tokens=20, stop_ids=[1]).tokens
            got = speculative_generate(target, dm.drafter, dm.head, p, DecodeSettings(builder=builder, budget=8,
                                                                                      max_new_tokens=20, stop_ids=[1]))
            assert got.tokens == want
