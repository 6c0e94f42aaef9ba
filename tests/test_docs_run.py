"""Docs that run: every ```python block in README.md and docs/ executes as written.

A block runs in a fresh namespace, in a child process (so a block that starts a
server or waits forever cannot hang the suite: each block has ``BLOCK_TIMEOUT``
seconds, the child as a whole a ceiling), with a routes file in its working
directory and ``TIERCHAIN_ROUTES_FILE`` naming it, as the quick start sets up. A
block whose fence is preceded by the line ``<!-- fragment -->`` continues an
earlier one (``app.add_middleware(...)`` lines, say) and is only compiled.

Each example gateway has a run command, in the README and in its module
docstring, and that command starts it under uvicorn.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tierchain.__main__ import main as cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOC_FILES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
FRAGMENT = "<!-- fragment -->"
BLOCK_TIMEOUT = 20
ROUTES_TOML = """\
[[routes.echo.backends]]
name = "tower"
url = "http://127.0.0.1:11434"
regime = "local"

[[routes.echo.backends]]
name = "hosted"
url = "https://api.example.com"
regime = "hosted"
api_key_env = "HOSTED_API_KEY"
"""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    fragment: bool

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of ``path``, each marked a fragment when the line above says so."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        if re.fullmatch(r"```(python|py)\s*", lines[i]):
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            fragment = i > 0 and lines[i - 1].strip() == FRAGMENT
            found.append(Block(path, i + 1, "\n".join(lines[i + 1 : end]) + "\n", fragment))
            i = end
        i += 1
    return found


BLOCKS = [block for path in DOC_FILES for block in python_blocks(path)]

# The child: run each block in a fresh namespace under an alarm; one JSON line per block.
RUNNER = textwrap.dedent(
    """
    import json, signal, sys, traceback, types

    blocks, results, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3])

    class BlockTimeout(BaseException):
        pass

    def alarm(signum, frame):
        raise BlockTimeout(f"still running after {timeout} s")

    signal.signal(signal.SIGALRM, alarm)
    with open(blocks) as f, open(results, "w") as out:
        for n, block in enumerate(json.load(f)):
            module = types.ModuleType(f"docs_block_{n}")  # a real module: frameworks look it up
            sys.modules[module.__name__] = module
            signal.alarm(timeout)
            try:
                exec(compile(block["code"], block["id"], "exec"), module.__dict__)
                error = None
            except BaseException:
                error = traceback.format_exc(limit=-8)
            finally:
                signal.alarm(0)
            out.write(json.dumps({"id": block["id"], "error": error}) + "\\n")
            out.flush()
    """
)


def run_blocks(blocks: list[Block], workdir: Path, *, timeout: int) -> dict[str, str | None]:
    """Run ``blocks`` in one child process; block id -> None (ran) or the error it raised."""
    (workdir / "routes.toml").write_text(ROUTES_TOML)
    spec = workdir / "blocks.json"
    spec.write_text(json.dumps([{"id": b.id, "code": b.code} for b in blocks]))
    results = workdir / "results.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCHAIN_")}
    env.update(
        TIERCHAIN_ROUTES_FILE="routes.toml",
        HOSTED_API_KEY="sk-docs-example",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
    )
    command = [sys.executable, "-c", RUNNER, str(spec), str(results), str(timeout)]
    try:
        done = subprocess.run(
            command,
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout * len(blocks) + 30,
            check=False,
        )
        tail = (done.stdout + done.stderr)[-2000:]
    except subprocess.TimeoutExpired as exc:
        tail = f"the runner was killed after {exc.timeout} s"
    outcome: dict[str, str | None] = {}
    if results.exists():
        for line in results.read_text().splitlines():
            row = json.loads(line)
            outcome[row["id"]] = row["error"]
    for block in blocks:
        outcome.setdefault(block.id, f"never finished; the runner said: {tail}")
    return outcome


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, str | None]:
    runnable = [b for b in BLOCKS if not b.fragment]
    return run_blocks(runnable, tmp_path_factory.mktemp("docs"), timeout=BLOCK_TIMEOUT)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_every_python_block_runs_or_as_a_fragment_compiles(block, ran):
    if block.fragment:
        compile(block.code, block.id, "exec")
        return
    error = ran[block.id]
    assert error is None, f"{block.id} failed:\n{error}"


def test_the_readme_gateway_and_the_quick_start_run_rather_than_only_compile():
    runs = {b.path.name for b in BLOCKS if not b.fragment}
    assert {"README.md", "index.md", "admin.md", "ordering.md"} <= runs
    assert sum(b.fragment for b in BLOCKS) < len(BLOCKS) / 2


def test_the_runner_reports_a_failing_block_and_stops_a_hanging_one(tmp_path):
    bad = [
        Block(README, 1, "undefined_name\n", False),
        Block(README, 2, "import time\ntime.sleep(60)\n", False),
        Block(README, 3, "x = 1\n", False),
    ]
    outcome = run_blocks(bad, tmp_path, timeout=1)
    assert "NameError" in (outcome[bad[0].id] or "")
    assert "still running after 1 s" in (outcome[bad[1].id] or "")
    assert outcome[bad[2].id] is None


def test_a_fragment_marker_only_applies_to_the_block_right_below_it(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- fragment -->\n```python\napp.add_middleware(X)\n```\n\n"
        "<!-- fragment -->\n\n```python\nprint(1)\n```\n"
    )
    first, second = python_blocks(page)
    assert first.fragment
    assert not second.fragment


# -- words that belong to how the project is run, not to its users --------------------

INTERNAL = re.compile(
    r"\bthe brief\b|\bbrief's\b|\bseeds?[ -]?0\d\d\b|\bissue #?\d+\b|\bthe issue (was|is) silent\b",
    re.IGNORECASE,
)
USER_FACING = [
    *DOC_FILES,
    *sorted((ROOT / "src" / "tierchain").rglob("*.py")),
    *sorted((ROOT / "examples").rglob("*.py")),
]


def test_no_project_internal_words_in_user_facing_text():
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in USER_FACING
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if INTERNAL.search(line)
    ]
    assert not found, "\n".join(found)
    assert INTERNAL.search("as in seed 002's table")
    assert INTERNAL.search("in the brief's order")


def help_text(*args: str) -> str:
    """What ``tierchain ARGS --help`` prints, asked of the command line in this process (a
    second Python start-up per command only repeated the top level's, asked below)."""
    out = io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(out),
        contextlib.suppress(SystemExit),
    ):
        cli([*args, "--help"])
    return out.getvalue()


def test_cli_help_has_no_project_internal_words():
    done = subprocess.run(
        [sys.executable, "-m", "tierchain", "--help"], capture_output=True, text=True, check=False
    )
    top = done.stdout + done.stderr
    assert top == help_text()  # the installed command line is the one asked in process
    commands = re.findall(r"^    ([a-z][a-z-]+)", top, re.MULTILINE)
    assert "check-config" in commands
    for text in [top, *(help_text(command) for command in commands)]:
        assert "usage:" in text
        assert not INTERNAL.search(text), text


# -- the examples' run commands ------------------------------------------------------

EXAMPLES = sorted(p.parent.name for p in (ROOT / "examples").glob("*/app.py"))
RUN_COMMAND = re.compile(r"uvicorn --factory (examples\.(\w+)\.app):(\w+)")


def run_commands(text: str) -> dict[str, str]:
    """example name -> its ``module:factory`` from every run command in ``text``."""
    return {m[2]: f"{m[1]}:{m[3]}" for m in RUN_COMMAND.finditer(text)}


@pytest.mark.parametrize("example", EXAMPLES)
def test_each_example_has_a_run_command_that_starts_it(example):
    in_readme = run_commands(README.read_text())
    in_module = run_commands((ROOT / "examples" / example / "app.py").read_text())
    assert example in in_readme, f"README.md gives no run command for examples/{example}"
    assert in_module.get(example) == in_readme[example]
    target = in_readme[example]
    command = [sys.executable, "-m", "uvicorn", "--factory", target, "--port", "0"]
    command += ["--host", "127.0.0.1"]
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if "Application startup complete" in line:
                break
        assert any("Application startup complete" in line for line in seen), "".join(seen)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
