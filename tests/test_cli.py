"""The one way a command-line program refuses input (dartree.base.cli): one stderr line, exit status 2."""

from dartree.base.cli import fail, first_line


def test_fail_prints_one_error_line_and_returns_the_exit_status(capsys):
    assert fail("--limit must be >= 1, got 0") == 2
    assert capsys.readouterr().err == "error: --limit must be >= 1, got 0\n"
    assert fail("error: already prefixed", code=3) == 3
    assert capsys.readouterr().err == "error: already prefixed\n"
    assert fail(OSError("cannot load the target\nTraceback-like detail\nmore")) == 2
    assert capsys.readouterr().err == "error: cannot load the target\n"


def test_first_line_names_an_exception_without_a_message():
    assert first_line(KeyError()) == "KeyError" and first_line(ValueError("  a\nb ")) == "a"
