"""Families from outside dartree reach every program: a recipe's ``families`` list imports modules for a training run,
and the ``dartree.families`` entry points of installed packages register families for every program
(dartree.models.families.plugins; docs/families.md)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dartree.models.checkpoint import CheckpointError, build_from_config
from dartree.models.families import FAMILIES, Family, Objective, register_family
from dartree.models.families.base import REQUIRED_FAMILY_METHODS
from dartree.models.families.plugins import import_families, load_entry_point_families
from dartree.models.heads import (HEADS, LOW_RANK_METHODS, REQUIRED_HEAD_METHODS, CorrectionHead, IdentityHead,
                                  register_head)
from dartree.base.fields import Range
from dartree.training.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def _dist(site: Path, name: str, group: str, entries: dict[str, str]) -> None:
    """An installed distribution as importlib.metadata finds it on sys.path: ``NAME-0.1.dist-info`` with METADATA and
    an entry_points.txt declaring ``entries`` (entry name -> module) in ``group``."""
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))


def test_entry_points_import_each_module_once_and_a_broken_one_is_named(tmp_path, monkeypatch):
    group = "dartree.families.test-only"  # a group of this test's own: the real registry is left as it is
    (tmp_path / "plug_ok.py").write_text("LOADED = True\n")
    (tmp_path / "plug_broken.py").write_text("raise RuntimeError('the family needs a GPU library')\n")
    _dist(tmp_path, "good_plugin", group, {"good": "plug_ok"})
    _dist(tmp_path, "bad_plugin", group, {"bad": "plug_broken"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match=r"dartree.families.test-only entry point 'bad' = 'plug_broken' of bad_plugin "
                                         r"failed to import \(RuntimeError: the family needs a GPU library\); its "
                                         r"drafter family is not available"):
        assert load_entry_point_families(group) == ["plug_ok"]
    assert sys.modules["plug_ok"].LOADED is True
    assert load_entry_point_families(group) == []  # imported once: a second scan imports nothing
    monkeypatch.delitem(sys.modules, "plug_ok")


def test_a_recipe_names_family_modules_and_a_bad_one_is_refused_in_one_line(tmp_path, monkeypatch):
    with pytest.raises(RecipeError, match=r"^families: cannot import 'no_such_family' \(ModuleNotFoundError: No module "
                                          r"named 'no_such_family'\); put its folder on PYTHONPATH or install its "
                                          r"package \(command line\)$"):
        load_recipe(["recipe=tiny_dflash", "families=[no_such_family]"])
    with pytest.raises(RecipeError, match=r"^families in command line must be a list of module names, e.g. "
                                          r"families=\[my_family\]; got 3$"):
        load_recipe(["recipe=tiny_dflash", "families=3"])
    with pytest.raises(ValueError, match=r"^families: '' is not a module name"):
        import_families([""])
    with pytest.raises(RecipeError, match=r"loss.type 'toy' is unknown; use one of \['dflash', 'dflash2', 'domino', "
                                          r"'dspark', 'dspine'\] \(a family of your own registers when its module is "
                                          r"imported: families=\[MODULE\], or its package's dartree.families entry point"):
        load_recipe(["recipe=tiny_dflash", "loss.type=toy"])
    # a recipe file's own list is read too, and the command line's replaces it
    (tmp_path / "mod_a.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "r.yaml").write_text((REPO / "recipes" / "tiny_dflash.yaml").read_text() + "\nfamilies: [mod_a]\n")
    assert list(load_recipe([f"recipe={tmp_path / 'r.yaml'}"]).families) == ["mod_a"]
    with pytest.raises(RecipeError, match=r"cannot import 'mod_b'.*\(command line\)$"):
        load_recipe([f"recipe={tmp_path / 'r.yaml'}", "families=[mod_b]"])
    assert list(load_recipe(["recipe=tiny_dflash"]).families) == [] and "toy" not in FAMILIES


@pytest.fixture
def registry():
    """The family and head registries restored after the test, whatever it registered."""
    families, heads = dict(FAMILIES), dict(HEADS)
    yield
    FAMILIES.clear(), FAMILIES.update(families), HEADS.clear(), HEADS.update(heads)


HEAD_METHODS = {m: getattr(IdentityHead, m) for m in (*REQUIRED_HEAD_METHODS, *LOW_RANK_METHODS)}
FAMILY_METHODS = {"head_kwargs": lambda self, head, vocab_size, hidden_size: {"vocab_size": vocab_size},
                  "objective": lambda self, loss, head: Objective(gamma=loss["gamma"], corrected=False)}


def _family(name: str, head_name: str, fields: dict, drop: tuple = (), heads=None) -> Family:
    """A family ``name`` training one head class ``head_name`` (never built here; the identity head's methods) with
    recipe ``fields``; the family and head methods named in ``drop`` left undefined; ``heads`` replaces its heads."""
    head = type(f"Head_{head_name}", (CorrectionHead,),
                {"type_name": head_name, **{m: f for m, f in HEAD_METHODS.items() if m not in drop}})
    body = {"name": name, "heads": (head,) if heads is None else heads, "recipe_fields": fields}
    return type(f"Family_{name}", (Family,), {**body, **{m: f for m, f in FAMILY_METHODS.items() if m not in drop}})()


def test_a_refused_family_registers_nothing_and_names_what_it_clashes_with(registry):
    register_family(_family("fam_a", "head_a", {"a_scale": (1.0, Range(0, integer=False))}))
    with pytest.raises(ValueError, match=r"^family 'fam_b': recipe field head.a_scale is already declared with "
                                         r"default 1.0; use that default or another name$"):
        register_family(_family("fam_b", "head_b", {"a_scale": (2.0, Range(0, integer=False))}))
    assert "fam_b" not in FAMILIES and "head_b" not in HEADS  # its head was not registered either
    with pytest.raises(ValueError, match=r"^drafter family 'dspark' is already registered \(by "
                                         r"dartree.models.families.dspark.DSparkFamily\); give Family_dspark another "
                                         r"name$"):
        register_family(_family("dspark", "head_c", {}))
    assert "head_c" not in HEADS


def test_a_family_field_that_every_recipe_has_is_refused_by_the_recipe(registry):
    register_family(_family("fam_r", "head_r", {"rank": (3, Range(1))}))
    with pytest.raises(RecipeError, match=r"^drafter family 'fam_r' \(test_family_plugins\) declares recipe field "
                                          r"head.rank, which every recipe already has \(shared keys: .*\); give its "
                                          r"field a name of its own, e.g. fam_r_rank$"):
        load_recipe(["recipe=tiny_dspark"])


@pytest.mark.parametrize("drop, says", [
    (("objective",), "drafter family 'fam_m' (Family_fam_m) does not define objective(): every family must "
                     "(dartree.models.families.Family says what each returns); define it"),
    (("head_kwargs",), "drafter family 'fam_m' (Family_fam_m) does not define head_kwargs(): every family must"),
    (("head_kwargs", "objective"), "does not define head_kwargs(), objective(): every family must (dartree.models."
                                   "families.Family says what each returns); define them"),
    *[((m,), f"drafter family 'fam_m' (Family_fam_m): head class Head_head_m (type 'head_m') does not define {m}(): "
             "every correction head must (dartree.models.heads.CorrectionHead says what each returns); define it")
      for m in REQUIRED_HEAD_METHODS],
    (("out_rows",), "head class Head_head_m (type 'head_m') defines factors() but not out_rows(): the low-rank "
                    "form U[C] + factors · out_rows^T needs both; define out_rows() or neither (then score() alone "
                    "is used)"),
    (("factors",), "head class Head_head_m (type 'head_m') defines out_rows() but not factors()"),
])
def test_a_family_or_head_missing_a_method_is_refused_when_it_registers(registry, drop, says):
    """Each method a family or a head must define, left out, is refused at registration in one line naming the class
    and the method (before, it registered and training died later in a bare NotImplementedError); nothing of the
    family registers."""
    with pytest.raises(ValueError) as info:
        register_family(_family("fam_m", "head_m", {}, drop=drop))
    assert says in str(info.value) and "\n" not in str(info.value)
    assert "fam_m" not in FAMILIES and "head_m" not in HEADS


def test_a_family_without_heads_or_a_head_class_without_its_own_type_name_is_refused(registry):
    with pytest.raises(ValueError, match=r"^drafter family 'fam_h' \(Family_fam_h\) has heads=\(\); set heads to the "
                                         r"tuple of head classes it trains$"):
        register_family(_family("fam_h", "head_h", {}, heads=()))
    with pytest.raises(ValueError, match=r"^drafter family 'fam_h' \(Family_fam_h\): <class 'int'> is not a head "
                                         r"class; derive it from dartree.models.heads.CorrectionHead$"):
        register_family(_family("fam_h", "head_h", {}, heads=(int,)))
    nameless = type("Nameless", (IdentityHead,), {"type_name": CorrectionHead.type_name})
    with pytest.raises(ValueError, match=r"^head class Nameless has no type_name of its own; set type_name \(its "
                                         r"checkpoints' head.type\)$"):
        register_head(nameless)
    bare = type("Bare", (CorrectionHead,), {"type_name": "bare", "score": IdentityHead.score})
    with pytest.raises(ValueError, match=r"^head class Bare \(type 'bare'\) does not define init_state\(\), "
                                         r"advance\(\), block_factors\(\): every correction head must"):
        register_head(bare)
    assert "fam_h" not in FAMILIES and "bare" not in HEADS
    register_family(_family("fam_h", "head_h", {}))  # complete: registers
    assert FAMILIES["fam_h"].head_types() == ["head_h"] and "head_h" in HEADS


def _raises_not_implemented(cls) -> set[str]:
    """The methods whose own body raises NotImplementedError in ``cls`` (read from its source)."""
    import ast
    import inspect

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {fn.name for fn in tree.body[0].body if isinstance(fn, ast.FunctionDef)
            and any(isinstance(st, ast.Raise) and "NotImplementedError" in ast.unparse(st) for st in fn.body)}


def test_every_method_the_base_classes_leave_unimplemented_is_checked():
    assert _raises_not_implemented(Family) == set(REQUIRED_FAMILY_METHODS) == {"head_kwargs", "objective"}
    assert _raises_not_implemented(CorrectionHead) == set(REQUIRED_HEAD_METHODS) | set(LOW_RANK_METHODS)
    assert set(LOW_RANK_METHODS) == {"factors", "out_rows"}  # optional as a pair: the builders fall back to score()


def test_a_family_module_that_fails_to_import_is_one_line_naming_why(tmp_path, monkeypatch, registry):
    (tmp_path / "fam_raises.py").write_text("raise RuntimeError('this family needs a GPU library')\n")
    (tmp_path / "fam_needs.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "fam_syntax.py").write_text("def broken(:\n")
    (tmp_path / "fam_twice.py").write_text(
        "from dartree.models.families import Family, register_family\n"
        "class Again(Family):\n    name = 'dflash'\n"
        "register_family(Again())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"^families: importing 'fam_raises' failed \(RuntimeError: this family "
                                         r"needs a GPU library\)$"):
        import_families(["fam_raises"])
    with pytest.raises(ValueError, match=r"^families: module 'fam_needs' imports 'no_such_dependency_xyz', which is "
                                         r"not installed; install it$"):
        import_families(["fam_needs"])
    with pytest.raises(ValueError, match=r"^families: importing 'fam_syntax' failed \(SyntaxError: "):
        import_families(["fam_syntax"])
    with pytest.raises(RecipeError, match=r"^families: importing 'fam_twice' failed \(ValueError: drafter family "
                                          r"'dflash' is already registered \(by dartree.models.families.dflash."
                                          r"DFlashFamily\); give Again another name\) \(command line\)$"):
        load_recipe(["recipe=tiny_dflash", "families=[fam_twice]"])


def test_a_checkpoint_of_an_unregistered_head_is_refused_in_one_line():
    config = json.loads((REPO / "checkpoints" / "dspark_b16" / "config.json").read_text())
    config["head"] = {"type": "toy_tanh", "vocab_size": 49152, "rank": 8}
    with pytest.raises(CheckpointError, match=r"^ckpt/config.json: unknown head type 'toy_tanh'; available: "
                                              r"\['dspine', 'gated_markov', .*install its package, whose dartree.families "
                                              r"entry point imports it, or, from Python, import the module first\)$"):
        build_from_config(config, "ckpt/config.json")


@pytest.mark.slow  # trains and evaluates end to end, three programs in subprocesses
def test_a_family_of_ones_own_trains_from_the_cli_and_evaluates_through_its_entry_point(tmp_path):
    plug, site = tmp_path / "plug", tmp_path / "site"
    plug.mkdir()
    # the toy family of tests/test_toy_family.py, registered when this module is imported
    (plug / "toy_cli_family.py").write_text(textwrap.dedent("""\
        from test_toy_family import ToyFamily
        from dartree.models.families import register_family
        register_family(ToyFamily())
    """))
    # fresh processes: no rendezvous variables of a training run earlier in this test session
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR",
                                                              "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", DARTREE_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(TESTS), str(plug), str(site)]))

    def cli(*args):
        return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)

    r = cli("training/train.py", "recipe=tiny_dflash", "families=[toy_cli_family]", "loss.type=toy",
            "head.type=toy_tanh", "head.rank=8", "head.toy_scale=0.5", "train.max_steps=2", "train.engine=torch",
            f"output_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoint"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["head"]["type"] == "toy_tanh" and config["head"]["scale"] == 0.5
    assert json.loads((ckpt / "training.json").read_text())["recipe"]["families"] == ["toy_cli_family"]

    convert = ("convert/to_dartree.py", str(ckpt), "--out", str(tmp_path / "dt"))
    r = cli(*convert)  # no entry point yet: the head type is unknown, and the message says how to register it
    assert r.returncode == 2 and "unknown head type 'toy_tanh'" in r.stderr and "dartree.families entry point" in \
        r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "dt").exists()
    _dist(site, "toy_plugin", "dartree.families", {"toy": "toy_cli_family"})
    r = cli(*convert)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    # a fresh process that never names the toy module loads and decodes the converted drafter (its package's entry
    # point registers the family), with output equal to greedy AR decoding of the tiny target
    decode = textwrap.dedent(f"""\
        import json, sys
        from dartree.decode.generate import autoregressive_generate, speculative_generate
        from dartree.decode.settings import DecodeSettings
        from dartree.models.checkpoint import load_dartree
        from dartree.models.target import load_target
        target = load_target("tiny-qwen3")
        dm = load_dartree({str(tmp_path / "dt")!r}, target=target)
        target.set_layer_ids(dm.drafter.cfg.target_layer_ids)
        same = []
        for builder in ("pruned", "chain"):
            for p in ([5, 9, 13, 2], [7, 7, 3]):
                want = autoregressive_generate(target, p, max_new_tokens=16, stop_ids=[1]).tokens
                got = speculative_generate(target, dm.drafter, dm.head, p,
                                           DecodeSettings(builder, 8, max_new_tokens=16, stop_ids=[1])).tokens
                same.append(got == want and len(got) > 0)
        print(json.dumps({{"head": type(dm.head).__name__, "same": same}}))
    """)
    r = cli("-c", decode)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"head": "TanhBigramHead", "same": [True] * 4}
