"""docs/contributing.md names commands, scripts, fixtures and helpers that exist."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from . import support

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "contributing.md"


def dev_commands() -> set[str]:
    """What ``python3 dev.py`` with no command lists (it exits before making .venv/)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "dev.py")], capture_output=True, text=True, check=False
    )
    assert done.returncode == 2, done.stdout + done.stderr
    line = re.search(r"^commands: (.+)$", done.stdout, re.M)
    assert line is not None, done.stdout
    return {c.strip() for c in line.group(1).split("|")}


def test_every_dev_py_command_the_docs_give_is_one_dev_py_has():
    commands = dev_commands()
    assert {"demo", "test", "lint", "docs", "bench"} <= commands
    for path in (PAGE, ROOT / "README.md"):
        used = set(re.findall(r"python3 dev\.py (\w+)", path.read_text()))
        assert used, path
        assert used <= commands, f"{path.name} names dev.py commands it lacks: {used - commands}"
    assert set(re.findall(r"^python3 dev\.py (\w+)", PAGE.read_text(), re.M)) == commands


def test_every_script_the_page_names_exists():
    scripts = set(re.findall(r"\b(bench/\w+\.py)\b", PAGE.read_text()))
    assert {"bench/overhead.py", "bench/layers.py", "bench/waiting.py"} <= scripts
    missing = sorted(s for s in scripts if not (ROOT / s).is_file())
    assert not missing, missing


def test_the_fixtures_and_helpers_the_page_points_to_exist():
    text = PAGE.read_text()
    fixtures = set(re.findall(r"the `(\w+)` fixture", text))
    assert {"redis_server", "browser", "manual_clock"} <= fixtures
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    defined = set(re.findall(r"@pytest\.fixture[^\n]*\n(?:async )?def (\w+)", conftest))
    assert fixtures <= defined, f"no such fixture in tests/conftest.py: {fixtures - defined}"
    reuse = re.search(r"\*\*Reuse `tests/support\.py`\*\* \(([^)]*)\)", text)
    assert reuse is not None
    helpers = set(re.findall(r"`(\w+)`", reuse.group(1)))
    helpers |= set(re.findall(r"`tests\.support\.(\w+)`", text))
    assert {"serve", "FakeBackend", "parse_sse"} <= helpers
    absent = sorted(h for h in helpers if not hasattr(support, h))
    assert not absent, f"tests/support.py has no {absent}"


def test_every_mutation_target_names_a_module_and_tests_that_exist_and_the_page_gives_them():
    dev = support.load_script(ROOT / "dev.py", "tierchain_dev")
    for target, (path, names, tests) in dev.MUTATE.items():
        paths = [path] if isinstance(path, str) else path  # a file, or the files of one rule
        assert all((ROOT / p).is_file() for p in paths), (target, paths)
        modules = [p.removeprefix("src/").removesuffix(".py").replace("/", ".") for p in paths]
        assert all(any(n.startswith(m + ".x") for m in modules) for n in names), (target, names)
        missing = [t for t in tests if not (ROOT / t).is_file()]
        assert not missing, (target, missing)
    quoted = set(re.findall(r"python3 dev\.py mutate ([\w-]+)", PAGE.read_text()))
    assert quoted, "docs/contributing.md quotes no mutation score"
    assert quoted <= set(dev.MUTATE), quoted - set(dev.MUTATE)
    pyproject = (ROOT / "pyproject.toml").read_text()
    # dev.py fills these two lines in its scratch copy: they must stay as they are.
    assert "\nonly_mutate = []\n" in pyproject
    assert "\npytest_add_cli_args_test_selection = []\n" in pyproject


def test_the_suite_runs_as_the_page_says_first_part_on_its_workers_then_the_alone_tests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dev = support.load_script(ROOT / "dev.py", "tierchain_dev")
    calls: list[list[str]] = []

    def call(cmd: list[str], **_: object) -> int:
        calls.append(cmd[3:])  # after the venv's python -m pytest
        return 0

    monkeypatch.setattr(dev.subprocess, "call", call)
    assert dev.test([], {}) == 0
    page = PAGE.read_text()
    first = re.search(r"^\.venv/bin/python -m pytest (.+?)\s+# the first part$", page, re.M)
    second = re.search(r"^\.venv/bin/python -m pytest (.+?)\s+# the second$", page, re.M)
    assert first is not None
    assert second is not None
    assert calls == [shlex.split(first.group(1)), shlex.split(second.group(1))]
    assert "every test not marked `alone` on three pytest-xdist workers" in page
    assert first.group(1).startswith("-n 3 ")
