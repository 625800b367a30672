"""Packaging guards: dartree.* imports, a cheap kernels package, and transformers' `kernels` probe."""

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_kernels_package_is_cheap():
    r = _run("import sys; import dartree.kernels as k; "
             "print('torch' in sys.modules, 'triton' in sys.modules, hasattr(k, '__version__'))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False", "False"]


@pytest.mark.slow
def test_transformers_imports_with_repo_root_on_path():
    # the repository root holds a folder named `kernels`; transformers probes for that package name
    r = _run("import sys; sys.path.insert(0, '.'); import transformers; "
             "from transformers import Qwen3Config, Qwen3ForCausalLM; "
             "m = Qwen3ForCausalLM(Qwen3Config(vocab_size=16, hidden_size=8, intermediate_size=16, "
             "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4)); print('ok')")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")


def test_version_outside_kernels_probe_range():
    v = tuple(int(x) for x in version("dartree").split(".")[:3])
    assert not ((0, 18, 2) <= v < (0, 19, 0))


@pytest.mark.slow
def test_scripts_run_from_repo_root():
    for script in ("training/train.py", "convert/to_dartree.py", "decode/eval.py"):
        r = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (script, r.stderr[-2000:])
        assert "dartree" in r.stdout.lower() or "recipe" in r.stdout.lower()


@pytest.mark.parametrize("target", ["test", "test-fast"])
def test_the_make_test_commands_end_with_pytests_summary_line(target, tmp_path):
    # `make test` runs pytest with the Makefile's options on top of pyproject's addopts; a doubled -q drops the
    # closing "N passed ..." line that users and CI read
    import re
    import shlex

    rule = re.search(rf"^{re.escape(target)}:.*\n\t\$\(PY\) -m pytest ((?:.* )?)tests$", (REPO / "Makefile").read_text(),
                     flags=re.M)
    assert rule, f"the Makefile's {target} rule runs pytest on tests/"
    probe = tmp_path / "test_probe.py"
    probe.write_text("import pytest\n\ndef test_a():\n    assert 1 + 1 == 2\n\n"
                     "@pytest.mark.skip(reason='probe')\ndef test_b():\n    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", *shlex.split(rule.group(1)), str(probe), "-p",
                        "no:cacheprovider", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^1 passed, 1 skipped in [0-9.]+s", r.stdout, flags=re.M), r.stdout
