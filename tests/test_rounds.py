"""The parts the speculative loop calls (decode/rounds.py), the builder registry's declared parameters
(decode/builders/__init__.py) with the command-line flags derived from them (decode/harness/builder_args.py), and the
per-prompt step eval and bench share (decode/harness/runner.py)."""

import argparse

import pytest
import torch

from conftest import make_drafter, make_markov
from dartree.decode.budget import CostModel
from dartree.decode.builders import (BUILDERS, PARAM_BETA, PARAM_K, BuilderParam, builder_beta,
                                     builder_signature_problem, check_builder_params, declared_params, ranks_by_beta,
                                     register_builder)
from dartree.decode.generate import autoregressive_generate, speculative_generate
from dartree.decode.harness.builder_args import add_builder_param_args, builder_param_problems, builder_params_of
from dartree.decode.harness.runner import against_ar, decode_one, first_divergence
from dartree.decode.rounds import AutoBudget, FixedBudget, Lockstep, LookupGraft
from dartree.decode.settings import DecodeSettings
from dartree.decode.trees import Tree

STOP = 1


def test_builders_declare_their_parameters():
    assert list(declared_params()) == ["k", "backend", "width", "beta", "children"]
    assert [p.name for p in BUILDERS["pruned"].params] == ["k", "width", "beta", "backend"]
    assert [p.name for p in BUILDERS["ddtree"].params] == ["backend"]
    assert {n for n in BUILDERS if ranks_by_beta(n)} == {"pruned", "heap-sequential"}
    assert ranks_by_beta("dartree-pruned") and not ranks_by_beta("dartree-fixed")
    assert builder_beta("pruned") == -0.2 and builder_beta("heap-sequential", {"beta": -0.5}) == -0.5
    assert builder_beta("chain", {"beta": -0.5}) == 0.0 and builder_beta("pctree") == 0.0
    assert PARAM_K.default == 64 and PARAM_K.flag == "--candidates" and PARAM_K.dest == "candidates"


@pytest.mark.parametrize("params, exc, text", [
    ({"width": 0}, ValueError, "builder_params['width']=0 must be an integer >= 1"),
    ({"k": 1.5}, TypeError, "builder_params['k']=1.5 must be an integer >= 1"),
    ({"beta": 0.25}, ValueError, "must be a finite number <= 0 (beta > 0 breaks DARTree's prefix closure)"),
    ({"beta": float("nan")}, ValueError, "must be a finite number <= 0"),
    ({"backend": "cuda"}, ValueError, "must be 'auto', 'torch' or 'triton'"),
    ({"depth": 3}, TypeError, "unknown key(s) ['depth']; known: ['backend', 'beta', 'children', 'k', 'width']"),
    ([("k", 4)], TypeError, "builder_params is list"),
])
def test_builder_params_are_checked_against_the_declarations(params, exc, text):
    with pytest.raises(exc) as info:
        check_builder_params(params)
    assert text in str(info.value)


def test_a_new_builder_brings_its_parameter_and_flag():
    depth = BuilderParam("max_depth", "int", 6, "deepest tree node", minimum=1, flag="--max-depth")

    def build(block, head, root_id, budget, *, max_depth: int = 6, **extra):
        return Tree.empty()

    register_builder("test-deep", params=(PARAM_K, depth))(build)
    try:
        check_builder_params({"max_depth": 3, "k": 8})
        with pytest.raises(ValueError, match="max_depth'\\]=0 must be an integer >= 1"):
            check_builder_params({"max_depth": 0})
        ap = argparse.ArgumentParser()
        add_builder_param_args(ap)
        args = ap.parse_args(["--max-depth", "4", "--width", "3"])
        assert builder_params_of(args) == {"k": 64, "width": 3, "beta": -0.2, "children": 4, "max_depth": 4}
        assert "deepest tree node (test-deep)" in ap.format_help()
    finally:
        del BUILDERS["test-deep"]
    assert "max_depth" not in declared_params()


def test_register_builder_refuses_a_parameter_that_means_something_else():
    other_width = BuilderParam("width", "int", 8, "another width", minimum=1, flag="--width")
    with pytest.raises(ValueError, match="declares parameter 'width' unlike the registered builders"):
        register_builder("test-wide", params=(other_width,))(lambda *a, **k: Tree.empty())
    with pytest.raises(ValueError, match="ranks by beta but declares no 'beta'"):
        register_builder("test-rank", params=(PARAM_K,), ranks_by_beta=True)(lambda *a, **k: Tree.empty())
    with pytest.raises(ValueError, match="already registered"):
        register_builder("pruned", params=(PARAM_BETA,))(lambda *a, **k: Tree.empty())
    assert "test-wide" not in BUILDERS and "test-rank" not in BUILDERS


def _takes_three(block, head, root_id):
    return Tree.empty()


def _no_extra(block, head, root_id, budget, *, k=64):
    return Tree.empty()


def _needs_depth(block, head, root_id, budget, *, depth, **extra):
    return Tree.empty()


def _other_default(block, head, root_id, budget, *, k=32, **extra):
    return Tree.empty()


def _k_positional_only(block, head, root_id, budget, k=64, /, **extra):
    return Tree.empty()


@pytest.mark.parametrize("fn, says", [
    (_takes_three, "tree builder 'test-sig' (_takes_three) takes 3 positional argument(s); a builder is called as "
                   "build(block, head, root_id, budget, **params)"),
    (_no_extra, "tree builder 'test-sig' (_no_extra) takes no **extra: every builder is called with the parameters "
                "all builders declare (['backend', 'beta', 'children', 'k', 'width']); add **extra and ignore the "
                "others"),
    (_needs_depth, "tree builder 'test-sig' (_needs_depth) requires argument 'depth', which no call passes; give it a "
                   "default (the declared one)"),
    (_other_default, "tree builder 'test-sig' (_other_default): its argument k=32 differs from the declared default "
                     "64; make them equal (a call without that parameter must mean the declared default)"),
    (_k_positional_only, "tree builder 'test-sig' (_k_positional_only) takes its declared parameter 'k' "
                         "positionally only; it is passed by keyword"),
])
def test_register_builder_refuses_a_function_that_cannot_take_its_declared_parameters(fn, says):
    """Checked at registration, in one line naming the builder, its function and the parameter (before, it
    registered and the first round died in a TypeError from inside the decoding loop)."""
    with pytest.raises(ValueError) as info:
        register_builder("test-sig", params=(PARAM_K,))(fn)
    assert str(info.value) == says and "test-sig" not in BUILDERS


def test_builders_that_keep_the_calling_convention_register():
    for fn in (lambda block, head, root_id, budget, **extra: Tree.empty(), lambda *a, **k: Tree.empty(),
               lambda block, head, root_id, budget, *, k=64, backend="auto", **extra: Tree.empty()):
        register_builder("test-ok", params=(PARAM_K,))(fn)
        assert BUILDERS.pop("test-ok").build is fn
    for builder in BUILDERS.values():  # the shipped ones pass their own check
        assert builder_signature_problem(builder.name, builder.build, builder.params) == ""


def test_eval_flags_keep_their_defaults_and_ranges():
    ap = argparse.ArgumentParser()
    add_builder_param_args(ap)
    args = ap.parse_args([])
    assert (args.candidates, args.width, args.beta, args.children) == (64, 12, -0.2, 4)
    assert builder_params_of(args) == {"k": 64, "width": 12, "beta": -0.2, "children": 4}
    help_text = " ".join(ap.format_help().split())
    assert "supertree width W per depth (pruned)" in help_text and "children per kept parent k (pctree)" in help_text
    assert "(<= 0) (pruned, heap-sequential)" in help_text
    bad = ap.parse_args(["--width", "0", "--beta", "0.5"])
    msgs = [m for b, m in builder_param_problems(bad) if b]
    assert msgs == ["--width 0 must be an integer >= 1",
                    "--beta 0.5 must be a finite number <= 0 (beta > 0 breaks DARTree's prefix closure)"]


def test_fixed_budget_learns_the_lookup_chain_and_keeps_the_tree():
    policy = FixedBudget(5)
    tree = Tree(torch.tensor([7, 8]), torch.tensor([0, 1]), torch.tensor([1, 2]), torch.tensor([-0.1, -0.3]))
    assert policy.drafts() and policy.choose(tree, None, True, 0.0) == (tree, None) and policy.recorded_budget(tree) == 5
    policy.observe(tree, torch.tensor([0, 1]), torch.tensor([1, 2]), 3, True, draft_s=0.0, verify_s=0.0, round_s=0.0)
    policy.observe(tree, torch.tensor([0, 1]), torch.tensor([1, 2]), 3, False, draft_s=0.0, verify_s=0.0, round_s=0.0)
    assert policy.lookup_stats.summary() == {"n=3": {1: [1, 1], 2: [1, 0]}}  # the undrafted round is not counted
    assert LookupGraft([5, 6, 5], 0, 3)(tree, [6], policy.lookup_stats) == (tree, None, 0)


def test_lookup_graft_adds_the_chain_after_the_last_match():
    graft = LookupGraft([5, 6, 7, 5, 6], 2, 2)
    tree, pos, n = graft(Tree.empty(), [], FixedBudget(0).lookup_stats)
    assert tree.tokens.tolist() == [7, 5] and tree.parents.tolist() == [0, 1] and pos.tolist() == [1, 2] and n == 2


def test_auto_budget_cuts_the_tree_and_times_the_build():
    cm = CostModel(t_ar=1.0, t_draft=0.1, verify_s={1: 1.0, 2: 1.02, 5: 1.1, 9: 1.2}, max_budget=4)
    clock = iter([10.5])
    policy = AutoBudget(cm, -0.2, clock=lambda: next(clock))
    assert policy.nodes == 4 and policy.lookup_stats is cm.lookup
    tree = Tree(torch.tensor([7, 8, 9, 3]), torch.tensor([0, 1, 2, 0]), torch.tensor([1, 2, 3, 1]),
                torch.tensor([-0.01, -0.02, -0.03, -5.0]))
    kept, pos = policy.choose(tree, None, True, build_started=10.0)
    assert pos is None and kept.size == policy.recorded_budget(kept) <= 4
    assert kept.tokens.tolist() == tree.tokens.tolist()[:kept.size]  # the best nodes first, prefix-closed
    same, pos = policy.choose(Tree.empty(), None, False, build_started=0.0)  # undrafted, no chain: the root alone
    assert same.size == 0 and pos is None


def test_lockstep_names_a_bad_callable_and_sums_its_time():
    with pytest.raises(TypeError, match="lockstep must be a callable"):
        Lockstep(3, clock=lambda: 0.0)
    seen, ticks = [], iter([2.0, 5.5])
    lock = Lockstep(seen.append, clock=lambda: next(ticks))
    lock(4, since=1.0)
    lock(9, since=5.0)
    assert seen == [4, 9] and lock.seconds == 1.5


def test_decode_one_times_and_checks_against_ar(target, prompts):
    drafter, head = make_drafter(), make_markov()
    ar = decode_one(target, prompts[2], DecodeSettings(None, max_new_tokens=14, stop_ids=[STOP]))
    assert ar.tokens == autoregressive_generate(target, prompts[2], max_new_tokens=14, stop_ids=[STOP]).tokens
    spec = decode_one(target, prompts[2], DecodeSettings("pruned", 4, {"width": 3}, max_new_tokens=14, stop_ids=[STOP]),
                      drafter=drafter, head=head, reference=ar.tokens, paired=True, seed=5)
    direct = speculative_generate(target, drafter, head, prompts[2], DecodeSettings(builder="pruned", budget=4,
                                                                                    max_new_tokens=14, stop_ids=[STOP],
                                                                                    builder_params={"width": 3}))
    assert spec.tokens == direct.tokens == ar.tokens and spec.mismatch is False and spec.first_divergence is None
    assert spec.stats.accept_lengths == direct.stats.accept_lengths and spec.stats.decode_s > 0
    assert spec.paired_ar.tokens == ar.tokens and spec.paired_ar.done
    wrong = ar.tokens[:3] + [(ar.tokens[3] + 1) % 96] + ar.tokens[4:]
    bad = decode_one(target, prompts[2], DecodeSettings("chain", max_new_tokens=14, stop_ids=[STOP]), drafter=drafter,
                     head=head, reference=wrong)
    assert bad.mismatch is True and bad.first_divergence == 3 and bad.paired_ar is None


def test_first_divergence_of_prefixes_and_equal_lists():
    assert first_divergence([1, 2, 3], [1, 2]) == 2 and first_divergence([4], [5]) == 0
    assert against_ar([1, 2], [1, 2]) == (False, None) and against_ar([1, 2], [1, 3]) == (True, 1)
