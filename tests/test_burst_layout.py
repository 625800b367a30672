"""The GPU burst's dartree without installing it (training/tools/burst_layout.py): the package laid out from
pyproject.toml's own package map, every package included, and the check that each imports from the layout alone."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dartree.training.tools.burst_layout import LayoutError, check, lay_out, main, package_dirs
from test_burst import _device_python

REPO = Path(__file__).resolve().parents[1]
LAYOUT = str(REPO / "training" / "tools" / "burst_layout.py")


def _project(root: Path, packages: dict[str, str], files: dict[str, str]) -> Path:
    """A project at ``root``: ``files`` (path -> text) and a pyproject.toml listing ``packages`` (name -> folder,
    its package-dir entry); returns the pyproject's path."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    lines = ["[tool.setuptools]", f"packages = {list(packages)!r}".replace("'", '"'), "",
             "[tool.setuptools.package-dir]", *(f'"{k}" = "{v}"' for k, v in packages.items())]
    (root / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return root / "pyproject.toml"


def test_the_repository_is_laid_out_from_its_package_map_with_every_package(tmp_path):
    dirs = package_dirs()
    assert dirs["dartree"] == REPO / "api" and dirs["dartree.base"] == REPO / "base"  # base: the one once left out
    assert dirs["dartree.kernels.tools"] == REPO / "kernels" / "tools"
    lay_out(tmp_path / "src")
    for pkg, folder in dirs.items():
        here = tmp_path.joinpath("src", *pkg.split("."))
        assert (here / "__init__.py").resolve() == folder / "__init__.py", pkg
    top = tmp_path / "src" / "dartree"
    assert not top.is_symlink() and (top / "speculator.py").resolve() == REPO / "api" / "speculator.py"
    assert (top / "base").is_symlink() and not (top / "__pycache__").exists()
    with pytest.raises(LayoutError, match=r"src exists; remove it first"):
        lay_out(tmp_path / "src")


def test_a_package_added_to_pyproject_is_laid_out_with_no_other_edit(tmp_path):
    init = "X = 1\n"
    pyproject = _project(tmp_path / "proj", {"pkg": "api", "pkg.sub": "sub", "pkg.sub.inner": "sub/inner",
                                             "pkg.moved": "elsewhere/moved", "pkg.fresh": "fresh"},
                         {"api/__init__.py": init, "api/top.py": init, "sub/__init__.py": init, "sub/notes.txt": "n",
                          "sub/inner/__init__.py": init, "elsewhere/moved/__init__.py": init,
                          "fresh/__init__.py": init})
    dirs = lay_out(tmp_path / "src", pyproject)
    assert sorted(dirs) == ["pkg", "pkg.fresh", "pkg.moved", "pkg.sub", "pkg.sub.inner"]
    pkg = tmp_path / "src" / "pkg"
    assert sorted(p.name for p in pkg.iterdir()) == ["__init__.py", "fresh", "moved", "sub", "top.py"]
    assert (pkg / "sub").resolve() == tmp_path / "proj" / "sub" and (pkg / "sub" / "notes.txt").read_text() == "n"
    assert (pkg / "moved" / "__init__.py").resolve() == tmp_path / "proj" / "elsewhere" / "moved" / "__init__.py"
    # a subpackage mapped away from its parent's folder: the parent is a real folder of links, not one link
    pyproject = _project(tmp_path / "p2", {"pkg": "api", "pkg.sub": "sub", "pkg.sub.inner": "inner"},
                         {"api/__init__.py": init, "sub/__init__.py": init, "sub/a.py": init,
                          "inner/__init__.py": init})
    lay_out(tmp_path / "src2", pyproject)
    sub = tmp_path / "src2" / "pkg" / "sub"
    assert not sub.is_symlink() and sorted(p.name for p in sub.iterdir()) == ["__init__.py", "a.py", "inner"]
    assert not (tmp_path / "p2" / "sub" / "inner").exists()  # nothing written into the tree


def test_an_unusable_package_map_is_one_line_naming_the_package(tmp_path):
    pyproject = _project(tmp_path / "a", {"pkg": "api", "pkg.gone": "gone"}, {"api/__init__.py": ""})
    with pytest.raises(LayoutError, match=r"package pkg.gone maps to .*gone, which has no __init__.py; fix its "
                                          r"\[tool.setuptools.package-dir\] entry$"):
        lay_out(tmp_path / "src", pyproject)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "pyproject.toml").write_text('[tool.setuptools.packages.find]\nwhere = ["."]\n')
    with pytest.raises(LayoutError, match=r"\[tool.setuptools\] packages must list the package names \(got "
                                          r"\{'find': \{'where': \['.'\]\}\}\)"):
        package_dirs(tmp_path / "b" / "pyproject.toml")
    pyproject = _project(tmp_path / "c", {"pkg": "api", "pkg.sub": "sub"},
                         {"api/__init__.py": "", "api/sub/__init__.py": "", "sub/__init__.py": ""})
    with pytest.raises(LayoutError, match=r"package pkg.sub maps to .*c/sub, but its parent's folder has an entry "
                                          r"'sub' of its own; rename one of them"):
        lay_out(tmp_path / "src3", pyproject)


def test_the_check_refuses_a_package_the_layout_lacks_or_another_dartree_supplies(tmp_path):
    """The failure the GPU machine met: a layout without dartree.base, on an interpreter with no dartree installed,
    is one line before the device stage starts; in a process where dartree is already imported from elsewhere,
    the check names where it came from."""
    lay_out(tmp_path / "src")
    py = _device_python(tmp_path / "python")
    run = [str(py), LAYOUT, str(tmp_path / "src"), "--check"]
    r = subprocess.run(run, env={**os.environ, "PYTHONPATH": str(tmp_path / "src")}, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == (f"burst: dartree imports from {tmp_path / 'src' / 'dartree'} "
                                              f"({len(package_dirs())} packages)\n"), r.stderr
    (tmp_path / "src" / "dartree" / "base").unlink()
    r = subprocess.run(run, env={**os.environ, "PYTHONPATH": str(tmp_path / "src")}, capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"error: dartree.base does not import from {tmp_path / 'src'} (ModuleNotFoundError: No module "
                        "named 'dartree.base'); is it in pyproject.toml's [tool.setuptools] packages?\n")
    import dartree  # this process's dartree, imported before from elsewhere than this layout

    with pytest.raises(LayoutError) as info:
        check(tmp_path / "src")
    assert str(info.value) == (f"dartree imports from {Path(dartree.__file__).absolute()}, not from the layout under "
                               f"{tmp_path / 'src'}: another dartree supplies it; put the layout first on PYTHONPATH")


def test_the_command_line_needs_only_the_standard_library_and_says_how_it_is_called(tmp_path, capsys):
    assert main([]) == 2 and main(["a", "--force"]) == 2 and main(["--check"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: usage: python training/tools/burst_layout.py DEST "
                                                    "[--check]"] * 3
    r = subprocess.run([sys.executable, "-I", "-S", LAYOUT, str(tmp_path / "src")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == (f"burst: dartree laid out under {tmp_path / 'src'} "
                                              f"({len(package_dirs())} packages, from pyproject.toml)\n"), r.stderr
