"""Small-data objectives (total variation, KL to the target), the data cursor and the learning-rate schedule across
the runs of a lineage (issue 42, item 6)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dartree.training.cursor import DataCursor, data_fingerprint, lineage_record
from dartree.training.fused_loss import fused_block_loss
from dartree.training.losses import dspark_loss
from dartree.training.recipe import RecipeError, load_recipe
from dartree.training.schedule import WarmupCosine

REPO = Path(__file__).resolve().parents[1]
LN = math.log


def _one(p):
    """[1, 1, V] log-probabilities of the distribution ``p`` (a list)."""
    return torch.log(torch.tensor(p, dtype=torch.float32))[None, None]


# ---- the loss terms, by hand ----

def test_total_variation_is_half_the_l1_and_decay_weighted():
    # p_d = (0.5, 0.3, 0.2), p_t = (0.2, 0.3, 0.5): L1 = 0.3 + 0 + 0.3 = 0.6, TV = 0.3
    pd, pt = _one([0.5, 0.3, 0.2]), _one([0.2, 0.3, 0.5])
    labels, valid = torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.bool)
    out = dspark_loss(pd, labels, valid, pt, gamma=7.0, ce_weight=0.0, l1_weight=0.0, tv_weight=1.0)
    assert float(out.loss) == pytest.approx(0.3, abs=1e-6) and float(out.l1) == pytest.approx(0.6, abs=1e-6)
    # 0.1 CE + 0.9 TV: CE = -ln 0.2
    out = dspark_loss(pd, labels, valid, pt, gamma=7.0, ce_weight=0.1, l1_weight=0.0, tv_weight=0.9)
    assert float(out.loss) == pytest.approx(0.1 * -LN(0.2) + 0.9 * 0.3, abs=1e-6)
    # two positions, TV 0.3 at k = 0 and 0 at k = 1 (a match): 0.3 * w0 / (w0 + w1), w_k = exp(-k / gamma)
    pd2 = torch.cat([pd, pt], dim=1)
    pt2 = torch.cat([pt, pt], dim=1)
    out = dspark_loss(pd2, torch.tensor([[2, 2]]), torch.ones(1, 2, dtype=torch.bool), pt2, gamma=2.0,
                      ce_weight=0.0, l1_weight=0.0, tv_weight=1.0)
    w1 = math.exp(-1 / 2.0)
    assert float(out.loss) == pytest.approx(0.3 / (1 + w1), abs=1e-6)
    # tv_weight w is l1_weight w / 2
    a = dspark_loss(pd2, torch.tensor([[2, 2]]), torch.ones(1, 2, dtype=torch.bool), pt2, gamma=2.0,
                    ce_weight=0.1, l1_weight=0.0, tv_weight=0.9)
    b = dspark_loss(pd2, torch.tensor([[2, 2]]), torch.ones(1, 2, dtype=torch.bool), pt2, gamma=2.0,
                    ce_weight=0.1, l1_weight=0.45)
    assert float(a.loss) == pytest.approx(float(b.loss), abs=1e-7)


def test_kl_to_the_target_by_hand():
    # KL(p_t || p_d), p_t = (0.2, 0.3, 0.5), p_d = (0.5, 0.3, 0.2): 0.2 ln(0.4) + 0.5 ln(2.5) = 0.3 ln 2.5
    pd, pt = _one([0.5, 0.3, 0.2]), _one([0.2, 0.3, 0.5])
    labels, valid = torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.bool)
    out = dspark_loss(pd, labels, valid, pt, gamma=7.0, ce_weight=0.0, l1_weight=0.0, kl_weight=1.0)
    assert float(out.kl) == pytest.approx(0.3 * LN(2.5), abs=1e-6) and float(out.loss) == pytest.approx(0.3 * LN(2.5))
    assert float(dspark_loss(pt, labels, valid, pt, gamma=7.0, ce_weight=0.0, l1_weight=0.0, kl_weight=1.0).loss) \
        == pytest.approx(0.0, abs=1e-6)
    # position decay: KL 0.3 ln 2.5 at k = 0, 0 at k = 1
    out = dspark_loss(torch.cat([pd, pt], 1), torch.tensor([[2, 2]]), torch.ones(1, 2, dtype=torch.bool),
                      torch.cat([pt, pt], 1), gamma=3.0, ce_weight=0.0, l1_weight=0.0, kl_weight=1.0)
    assert float(out.loss) == pytest.approx(0.3 * LN(2.5) / (1 + math.exp(-1 / 3)), abs=1e-6)


def test_lk_loss_by_hand_fixed_and_adaptive_lambda():
    # p_d = (0.5, 0.3, 0.2), p_t = (0.2, 0.3, 0.5): TV 0.3 (alpha = 0.7), KL(p_t || p_d) = 0.3 ln 2.5
    pd, pt = _one([0.5, 0.3, 0.2]), _one([0.2, 0.3, 0.5])
    labels, valid = torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.bool)
    kl, tv = 0.3 * LN(2.5), 0.3

    def lk(**kw):
        return float(dspark_loss(pd, labels, valid, pt, gamma=7.0, ce_weight=0.0, l1_weight=0.0, **kw).loss)

    assert lk(lk_weight=1.0, lk_lambda=0.25) == pytest.approx(0.25 * kl + 0.75 * tv, abs=1e-6)
    lam = math.exp(-3.0 * 0.7)  # adaptive: exp(-eta alpha), the paper's eta 3
    assert lk(lk_weight=1.0) == pytest.approx(lam * kl + (1 - lam) * tv, abs=1e-6)
    assert lk(lk_weight=2.0, lk_eta=1.0) == pytest.approx(2 * (math.exp(-0.7) * kl + (1 - math.exp(-0.7)) * tv),
                                                          abs=1e-6)
    # lambda 1 is the KL term, lambda 0 the TV term
    assert lk(lk_weight=1.0, lk_lambda=1.0) == pytest.approx(lk(kl_weight=1.0), abs=1e-7)
    assert lk(lk_weight=1.0, lk_lambda=0.0) == pytest.approx(lk(tv_weight=1.0), abs=1e-7)
    # a perfect draft: alpha 1, KL 0, TV 0
    assert float(dspark_loss(pt, labels, valid, pt, gamma=7.0, ce_weight=0.0, l1_weight=0.0, lk_weight=1.0).loss) \
        == pytest.approx(0.0, abs=1e-6)
    # the adaptive lambda carries no gradient: d/dx of lam*KL + (1-lam)*TV with lam held fixed
    x = pd.clone().requires_grad_()
    dspark_loss(x, labels, valid, pt, gamma=7.0, ce_weight=0.0, l1_weight=0.0, lk_weight=1.0).loss.backward()
    y = pd.clone().requires_grad_()
    dspark_loss(y, labels, valid, pt, gamma=7.0, ce_weight=0.0, l1_weight=0.0, lk_weight=1.0,
                lk_lambda=lam).loss.backward()
    torch.testing.assert_close(x.grad, y.grad)


def test_kl_and_tv_on_a_draft_vocabulary_by_hand():
    # target over 4 tokens (0.1, 0.2, 0.3, 0.4); the draft vocabulary is tokens {0, 2, 3}; the drafter uniform on it.
    # KL is to p_t renormalised over {0, 2, 3}: (0.125, 0.375, 0.5); TV adds p_t's 0.2 outside it.
    pt_full = torch.tensor([0.1, 0.2, 0.3, 0.4])
    cols = torch.tensor([0, 2, 3])
    pd = torch.full((1, 1, 3), 1 / 3).log()
    p_sub = pt_full[cols][None, None]
    want_kl = sum(q * LN(3 * q) for q in (0.125, 0.375, 0.5))
    want_tv = 0.5 * (abs(1 / 3 - 0.1) + abs(1 / 3 - 0.3) + abs(1 / 3 - 0.4) + 0.2)
    labels, valid = torch.tensor([[1]]), torch.ones(1, 1, dtype=torch.bool)
    ref = dspark_loss(pd, labels, valid, None, gamma=7.0, ce_weight=0.0, l1_weight=0.0, tv_weight=1.0, kl_weight=1.0,
                      target_probs=(p_sub, 1 - p_sub.sum(-1)))
    assert float(ref.kl) == pytest.approx(want_kl, abs=1e-6)
    assert float(ref.l1) / 2 == pytest.approx(want_tv, abs=1e-6)
    assert float(ref.loss) == pytest.approx(want_kl + want_tv, abs=1e-6)
    # the fused loss on the same numbers: w_out = I, so the drafter logits are the hidden states and the target's
    # logits on the draft columns are its hidden states; its full-vocabulary log-sum-exp is 0 (log-probabilities)
    h = pd.clone().requires_grad_()
    got = fused_block_loss(h, torch.eye(3), labels, valid, gamma=7.0, target_hidden=pt_full[cols].log()[None, None],
                           target_lse=torch.zeros(1, 1), ce_weight=0.0, l1_weight=0.0, tv_weight=1.0, kl_weight=1.0)
    assert float(got.kl) == pytest.approx(want_kl, abs=1e-6) and float(got.l1) / 2 == pytest.approx(want_tv, abs=1e-6)
    assert float(got.loss.detach()) == pytest.approx(want_kl + want_tv, abs=1e-6)
    # the KL alone needs no log-sum-exp (the renormalised p_t is the softmax of the draft columns)
    alone = fused_block_loss(h, torch.eye(3), labels, valid, gamma=7.0, target_hidden=pt_full[cols].log()[None, None],
                             ce_weight=0.0, l1_weight=0.0, kl_weight=1.0)
    assert float(alone.kl) == pytest.approx(want_kl, abs=1e-6) and float(alone.l1) == 0.0
    # its gradient with respect to the logits is p_d - p~_t
    alone.loss.backward()
    torch.testing.assert_close(h.grad[0, 0], torch.full((3,), 1 / 3) - torch.tensor([0.125, 0.375, 0.5]))


def _case(draft_vocab: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a, p, d, v, r, v_full = 5, 7, 16, 50, 4, 80
    h = torch.randn(a, p, d, generator=g).requires_grad_()
    fa = torch.randn(a, p, r, generator=g).requires_grad_()
    fw = torch.randn(v, r, generator=g).requires_grad_()
    conf = torch.randn(a, p, generator=g).requires_grad_()
    w_full = torch.randn(v_full, d, generator=g)
    labels = torch.randint(0, v, (a, p), generator=g)
    labels[0, 2] = -1
    valid = torch.ones(a, p, dtype=torch.bool)
    valid[1, 4:] = False
    th = torch.randn(a, p, d, generator=g)
    lse = torch.logsumexp(th @ w_full.T, -1) if draft_vocab else None
    return h, fa, fw, conf, w_full[:v], labels, valid, th, lse


@pytest.mark.parametrize("draft_vocab", [True, False])
@pytest.mark.parametrize("weights,with_conf", [
    (dict(ce_weight=0.1, l1_weight=0.0, tv_weight=0.9), True),  # CE + TV (+ the confidence BCE)
    (dict(ce_weight=0.1, l1_weight=0.0, kl_weight=0.9), False),  # CE + KL, no L1 computed at all
    (dict(ce_weight=0.1, l1_weight=0.2, tv_weight=0.3, kl_weight=0.7), True),  # every term at once
    (dict(ce_weight=0.1, l1_weight=0.0, lk_weight=0.9), False),  # CE + adaptive LK
    (dict(ce_weight=0.1, l1_weight=0.2, lk_weight=0.9, lk_lambda=0.3), True),  # CE + L1 + fixed-lambda LK + BCE
    (dict(ce_weight=0.0, l1_weight=0.0, kl_weight=0.2, lk_weight=1.0, lk_eta=5.0), False),  # KL + adaptive LK
])
@pytest.mark.parametrize("chunk", [3, None])
def test_fused_tv_and_kl_equal_the_materialised_loss_and_gradients(draft_vocab, weights, with_conf, chunk):
    h, fa, fw, conf, w_out, labels, valid, th, lse = _case(draft_vocab)
    conf = conf if with_conf else None
    got = fused_block_loss(h, w_out, labels, valid, gamma=7.0, chunk=chunk, factors=(fa, fw), target_hidden=th,
                           target_lse=lse, conf_logits=conf, conf_weight=1.0, **weights)
    got.loss.backward()
    leaves = [t for t in (h, fa, fw, conf) if t is not None]
    g_got = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    z = th @ w_out.T
    tp = None
    if draft_vocab:
        ps = torch.exp(z - lse[..., None])
        tp = (ps, (1 - ps.sum(-1)).clamp(min=0))
    want = dspark_loss(h @ w_out.T + fa @ fw.T, labels, valid, None if draft_vocab else z, gamma=7.0,
                       conf_logits=conf, conf_weight=1.0, target_probs=tp, **weights)
    want.loss.backward()
    for k in ("loss", "ce", "l1", "kl", "bce", "acc_per_pos"):
        torch.testing.assert_close(getattr(got, k).float(), getattr(want, k).float(), atol=1e-5, rtol=1e-5, msg=k)
    assert float(got.loss.detach()) > 0 and (not weights.get("kl_weight") or float(got.kl) > 0)
    for x, t in zip(g_got, leaves):
        assert t.grad.abs().sum() > 0
        torch.testing.assert_close(x, t.grad, atol=1e-5, rtol=1e-4)


def test_tv_and_kl_need_a_target_and_the_dspark_loss():
    h, fa, fw, conf, w_out, labels, valid, th, lse = _case(False)
    with pytest.raises(ValueError, match="target_hidden"):
        fused_block_loss(h, w_out, labels, valid, gamma=7.0, kl_weight=0.5)
    with pytest.raises(ValueError, match="target"):
        dspark_loss(h @ w_out.T, labels, valid, None, gamma=7.0, ce_weight=0.1, l1_weight=0.0, tv_weight=0.9)
    with pytest.raises(RecipeError, match="^loss.tv_weight=0.5 apply to loss.type=dspark"):
        load_recipe(["recipe=tiny_domino", "loss.tv_weight=0.5"])
    with pytest.raises(RecipeError, match="^loss.lk_weight=0.9 apply to loss.type=dspark only"):
        load_recipe(["recipe=tiny_domino", "loss.lk_weight=0.9"])
    with pytest.raises(RecipeError, match=r"^loss.lk_lambda=0.5 / loss.lk_eta=3.0 shape the LK loss, which is off"):
        load_recipe(["recipe=tiny_dspark", "loss.lk_lambda=0.5"])
    with pytest.raises(RecipeError, match="^loss.lk_lambda=1.5"):
        load_recipe(["recipe=tiny_dspark", "loss.lk_weight=0.9", "loss.lk_lambda=1.5"])
    with pytest.raises(ValueError, match="lk_weight need target_hidden"):
        fused_block_loss(h, w_out, labels, valid, gamma=7.0, lk_weight=0.5)
    assert load_recipe(["recipe=tiny_dspark", "loss.ce_weight=0", "loss.l1_weight=0", "loss.lk_weight=1"]).loss.lk_weight
    with pytest.raises(RecipeError, match="^loss.ce_weight=0 and loss.l1_weight=0"):
        load_recipe(["recipe=tiny_dspark", "loss.ce_weight=0", "loss.l1_weight=0"])
    assert load_recipe(["recipe=tiny_dspark", "loss.ce_weight=0", "loss.l1_weight=0", "loss.kl_weight=1"]).loss.kl_weight
    with pytest.raises(RecipeError, match="loss.kl_weight"):
        load_recipe(["recipe=tiny_dspark", "loss.kl_weight=-1"])
    with pytest.raises(RecipeError, match="^data.cursor_from_init=true continues init_from's run"):
        load_recipe(["recipe=tiny_dspark", "data.cursor_from_init=true"])
    with pytest.raises(RecipeError, match="^train.schedule_from_init=true"):
        load_recipe(["recipe=tiny_dspark", "train.schedule_from_init=true"])


def test_the_target_lse_is_computed_only_where_a_loss_reads_it():
    from dartree.training.settings import step_settings
    from dartree.training.step import needs_target_lse

    def needs(args):
        cfg = load_recipe(args)
        return needs_target_lse(step_settings(cfg), cfg.drafter.draft_vocab_size)

    vocab = ["drafter.draft_vocab_size=40"]
    assert needs(["recipe=tiny_dspark", *vocab])  # L1 and the confidence label
    assert not needs(["recipe=tiny_dspark"])  # the full vocabulary: p_t is a softmax
    kl_only = ["loss.l1_weight=0", "loss.kl_weight=0.9", "head.confidence_head=false"]
    assert not needs(["recipe=tiny_dspark", *vocab, *kl_only])
    assert needs(["recipe=tiny_dspark", *vocab, *kl_only, "train.fused_loss=false"])
    assert not needs(["recipe=tiny_dflash", *vocab])
    assert not needs(["recipe=tiny_domino", *vocab])


# ---- the data cursor ----

def test_cursor_visits_every_sequence_once_before_any_repeats_and_resumes_exactly():
    ids = [0, 1, 2, 4, 5, 7, 8]  # gaps: ids of sequences without a response token are not training ids
    whole = DataCursor(ids, seed=3).take(40)
    for e in range(40 // len(ids)):
        assert sorted(whole[e * len(ids):(e + 1) * len(ids)]) == ids  # each epoch a permutation of them
    assert whole[:len(ids)] != whole[len(ids):2 * len(ids)]  # and another one each epoch
    pieces, state = [], None
    for k in (3, 5, 1, 9, 2, 20):  # runs of any length, each continuing the previous one's saved position
        c = DataCursor.from_state(ids, 3, json.loads(json.dumps(state)) if state else None)
        pieces += c.take(k)
        state = c.state()
    assert pieces == whole


def test_cursor_on_grown_data_visits_the_new_sequences_before_any_repeat():
    old = list(range(6))
    c = DataCursor(old, seed=0)
    first = c.take(4)
    grown = DataCursor.from_state(list(range(10)), 0, c.state())  # four sequences appended
    nxt = grown.take(6)
    assert sorted(first + nxt) == list(range(10))  # the rest of the epoch: every sequence not yet seen in it
    assert set(grown.take(10)) == set(range(10))


def test_a_resumed_cursor_is_checked_against_the_data_by_content():
    """The resumable state's cursor names the data it was made on: the same sequences read from another folder (a
    moved checkout) resume; other sequences are refused by name instead of training on a cursor that means nothing."""
    from types import SimpleNamespace

    from dartree.training.cursor import run_cursor

    toks = [torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([1, 2, 3]), torch.tensor([5])]
    data = SimpleNamespace(tokens=toks, train_ids=[0, 1, 2, 3])
    c = DataCursor(data.train_ids, seed=1)
    first = c.take(3)
    saved = json.loads(json.dumps(c.state(data_fingerprint(toks, data.train_ids))))
    assert run_cursor(data, 1, resumed=None, lineage=None, seqs_per_step=1, init_from=None).state()["fingerprint"] \
        == saved["fingerprint"]  # every state a run's cursor saves names its data
    moved = SimpleNamespace(tokens=[t.clone() for t in toks], train_ids=[0, 1, 2, 3])
    resumed = run_cursor(moved, 1, resumed=(3, saved), lineage=None, seqs_per_step=1, init_from=None)
    assert sorted(first + resumed.take(1)) == [0, 1, 2, 3]  # the rest of the epoch, exactly
    other = SimpleNamespace(tokens=[*toks[:3], torch.tensor([6])], train_ids=[0, 1, 2, 3])
    with pytest.raises(RecipeError, match="resume=true: the saved state was trained on other sequences"):
        run_cursor(other, 1, resumed=(3, saved), lineage=None, seqs_per_step=1, init_from=None)
    unnamed = {k: v for k, v in saved.items() if k != "fingerprint"}  # a state saved before it named its data
    assert run_cursor(other, 1, resumed=(3, unnamed), lineage=None, seqs_per_step=1, init_from=None).take(1)


def test_data_fingerprint_names_the_sequences_in_order():
    toks = [torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([1, 2, 3])]
    assert data_fingerprint(toks, [0, 1]) == data_fingerprint([t.clone() for t in toks], [0, 1])
    assert data_fingerprint(toks, [0, 1]) != data_fingerprint(toks, [1, 0])
    assert data_fingerprint(toks, [0, 1]) != data_fingerprint([toks[0], torch.tensor([4])], [0, 1])


# ---- the learning-rate schedule across runs ----

def test_schedule_offset_continues_a_lineage_without_a_second_warmup():
    one = WarmupCosine(warm=2, total=10, cap_s=0)
    cont = WarmupCosine(warm=2, total=10, cap_s=0, offset=4)
    assert [cont(s) for s in range(6)] == [one(s) for s in range(4, 10)]
    assert cont(0) < 1.0 and one(0) == 0.5  # no warm-up again: the rate the lineage had reached
    # under a wall-clock cap the decay starts from the lineage's progress at the offset, not from the top
    capped = WarmupCosine(warm=2, total=10, cap_s=3600, offset=6)
    assert capped(0) == pytest.approx(one(6), rel=1e-6)
    assert WarmupCosine(warm=2, total=10, cap_s=3600)(2) == pytest.approx(1.0, rel=1e-6)


def test_lineage_record_of_checkpoints_without_one_is_empty(tmp_path):
    assert lineage_record(None) == {} and lineage_record(str(tmp_path / "gone")) == {}
    (tmp_path / "training.json").write_text(json.dumps({"recipe": {}, "state": {"steps": 3}}))
    assert lineage_record(str(tmp_path)) == {}
    (tmp_path / "training.json").write_text(json.dumps({"state": {"lineage": {"steps": 7}, "cursor": {"epoch": 1}}}))
    assert lineage_record(str(tmp_path)) == {"steps": 7, "cursor": {"epoch": 1}, "schedule_steps": 0}


# ---- runs ----

def _train(args, cache):
    env = {"DARTREE_CACHE": str(cache), "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           **{k: os.environ[k] for k in ("TORCH_EXTENSIONS_DIR",) if k in os.environ}}
    r = subprocess.run([sys.executable, "training/train.py", *args], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=900)
    return r


@pytest.mark.slow
def test_two_continued_runs_see_the_batches_anchors_and_rates_of_one_long_run(tmp_path):
    """Run A (4 steps) then run B continued from A's checkpoint (4 steps, data.cursor_from_init and
    train.schedule_from_init; both on an 8-step schedule) against one 8-step run C, 3 sequences a step over 10
    (epochs end inside steps): A logs C's first 4 losses, B's first loss is C's 5th (same weights, batch and anchors;
    B's optimiser moments start afresh, so its later losses differ), B's rates are C's last 4, and the cursors end
    in the same place. A resumed run continues the cursor too, and other data is refused by name."""
    cache = tmp_path / "cache"
    common = ["recipe=tiny_dspark", "train.threads=1", "train.seqs_per_step=3"]
    cont = ["data.cursor_from_init=true", "train.schedule_from_init=true", "train.schedule_steps=8"]
    runs = {"A": [*common, "train.max_steps=4", "train.schedule_steps=8"],
            "B": [*common, "train.max_steps=4", f"init_from={tmp_path / 'A' / 'checkpoint'}", *cont],
            "C": [*common, "train.max_steps=8"]}
    s, logs = {}, {}
    for name, args in runs.items():
        r = _train([*args, f"output_dir={tmp_path / name}"], cache)
        assert r.returncode == 0, r.stderr[-3000:]
        s[name], logs[name] = json.loads((tmp_path / name / "summary.json").read_text()), r.stdout
    a, b, c = s["A"], s["B"], s["C"]
    assert "continuing at epoch 1, 2 sequences into it" in logs["B"]
    assert "lineage reached step 4" in logs["B"]
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(c["losses"][:4]), rtol=1e-5, atol=0)
    assert b["losses"][0] == pytest.approx(c["losses"][4], rel=1e-5)
    assert a["lrs"] + b["lrs"] == pytest.approx(c["lrs"], rel=1e-6)
    assert b["lrs"][0] < c["lrs"][0]  # no second warm-up
    assert b["cursor"] == c["cursor"] and b["lineage"] == {"step0": 4, "steps": 8, "schedule_steps": 8}
    # resume: A's saved state continued to step 8 is C exactly (optimiser moments included)
    r = _train([*runs["A"], "train.max_steps=8", "resume=true", f"output_dir={tmp_path / 'A'}"], cache)
    assert r.returncode == 0, r.stderr[-3000:]
    ar = json.loads((tmp_path / "A" / "summary.json").read_text())
    torch.testing.assert_close(torch.tensor(ar["losses"]), torch.tensor(c["losses"]), rtol=1e-5, atol=0)
    assert ar["cursor"] == c["cursor"]
    # a cursor made on other sequences is refused in one line
    r = _train([*runs["B"], "data.seed=5", f"output_dir={tmp_path / 'D'}"], cache)
    assert r.returncode == 2 and "data.cursor_from_init=true:" in r.stderr + r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name,weights", [
    ("ce+tv", ["loss.l1_weight=0", "loss.tv_weight=0.9"]),
    ("ce+kl", ["loss.l1_weight=0", "loss.kl_weight=0.9"]),
    ("kl, draft vocabulary, no confidence head", ["loss.ce_weight=0", "loss.l1_weight=0", "loss.kl_weight=1",
                                                  "drafter.draft_vocab_size=40", "head.confidence_head=false"]),
])
def test_a_short_run_with_each_objective_lowers_its_loss(tmp_path, name, weights):
    out = tmp_path / "run"
    r = _train(["recipe=tiny_dspark", "train.threads=1", "train.max_steps=30", "train.lr=3e-3",
                "train.num_anchors=8", *weights, f"output_dir={out}"], tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-3000:]
    losses = json.loads((out / "summary.json").read_text())["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, (name, losses)


# ---- the on-disk feature store ----

def _rows(n, g):
    return [{"prompt_ids": torch.randint(2, 90, (5,), generator=g).tolist(),
             "response_ids": torch.randint(2, 90, (7 + k,), generator=g).tolist(), "loss_mask": [1] * (7 + k)}
            for k in range(n)]


def test_the_feature_store_gives_back_the_online_features_and_stays_bounded(target, tmp_path):
    from dartree.training.campaign_data import CampaignData
    from dartree.training.feature_store import FeatureStore, target_key

    rows = _rows(4, torch.Generator().manual_seed(0))
    online = CampaignData(target, rows, [], cache_size=1)
    online.need_lse = True
    store = FeatureStore(tmp_path / "fs", target, max_bytes=10**9)
    data = CampaignData(target, rows, [], cache_size=1, store=store)
    data.need_lse = True
    first = [data.sequence(i)[1:3] + (data.lse_of(i),) for i in range(4)]
    assert data.forward_tokens == sum(len(t) for t in data.tokens) and store.misses == 4 and store.hits == 0
    again = CampaignData(target, rows, [], cache_size=1, store=FeatureStore(tmp_path / "fs", target, 10**9))
    again.need_lse = True
    for i in range(4):  # a later run (nothing in memory) reads every sequence back: the same tensors, no forward
        feats, final, lse = again.sequence(i)[1], again.sequence(i)[2], again.lse_of(i)
        assert torch.equal(feats, first[i][0]) and torch.equal(final, first[i][1]) and torch.equal(lse, first[i][2])
        assert torch.equal(feats, online.sequence(i)[1]) and torch.equal(lse, online.lse_of(i))
    assert again.forward_tokens == 0 and again.store.hits >= 4
    # the key follows the captured layers; the files live in the given folder only
    files = sorted((tmp_path / "fs").rglob("*.pt"))
    assert len(files) == 4 and all(f.parent.name == target_key(target) for f in files)
    # bounded: room for about two sequences' files keeps the most recently used ones
    size = max(f.stat().st_size for f in files)
    small = CampaignData(target, rows, [], cache_size=1, store=FeatureStore(tmp_path / "small", target, 2.5 * size))
    for i in range(4):
        small.sequence(i)
    kept = list((tmp_path / "small").rglob("*.pt"))
    assert 1 <= len(kept) <= 2 and small.store.bytes <= 2.5 * size
    assert small.store.path(small.tokens[3]).exists()


def test_the_feature_store_is_for_campaign_data_only():
    with pytest.raises(RecipeError, match="^data.feature_store_gb=2.0 stores online features"):
        load_recipe(["recipe=tiny_dspark", "data.feature_store_gb=2"])
    with pytest.raises(RecipeError, match="data.feature_store_gb"):
        load_recipe(["recipe=tiny_dspark", "data.source=campaign", "data.feature_store_gb=-1"])
