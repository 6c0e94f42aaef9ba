#!/usr/bin/env python3
"""The front door: `python3 dev.py demo` and `python3 dev.py test`.

Both create `.venv/` on first use (only Python 3.11+ is needed) and install
tierchain with its `dev` extra into it, then run inside it. Any further
arguments go to the command: `python3 dev.py test -k failover -x`.

`python3 dev.py mutate TARGET` runs mutmut over one decision module (see MUTATE)
against the tests that cover it, in a scratch copy under `.mutants/TARGET/`, and
prints its score and every surviving mutant.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".tierchain-installed"


def _ensure_venv() -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 (dev.py runs on the system Python)
        sys.exit(f"tierchain needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    if not PY.exists():
        print(f"creating {VENV} ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted:
        return
    print("installing tierchain[dev] into .venv (first run only) ...", flush=True)
    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "-e", f"{ROOT}[dev]"], check=True)
    STAMP.write_text(wanted)


# The decision modules and the tests that cover them: target -> (file or files, the functions
# mutated as mutmut names them, the test files). mutmut names a function x_NAME and a
# method xǁCLASSǁNAME; docs/contributing.md quotes each target's score.
MUTATE: dict[str, tuple[str | list[str], list[str], list[str]]] = {
    "retry-after": (
        "src/tierchain/_responses.py",
        ["tierchain._responses.x_retry_after*"],
        ["tests/test_retry_after_date.py"],
    ),
    "windows": (
        ["src/tierchain/windows.py", "src/tierchain/memory_store.py"],
        [
            "tierchain.windows.x__bucket_of*",
            "tierchain.windows.x_window_sum*",
            "tierchain.windows.x_room_in*",
            "tierchain.windows.x_refuses*",
            "tierchain.memory_store.xǁMemoryStoreǁwindow_admit*",
            "tierchain.memory_store.xǁMemoryStoreǁwindow_hold*",
            "tierchain.memory_store.xǁMemoryStoreǁusage_record*",
        ],
        ["tests/test_limits_windows.py", "tests/test_limits.py"],
    ),
    "limits": (
        "src/tierchain/limits.py",
        [
            "tierchain.limits.xǁKeyLimitsǁ_limited*",
            "tierchain.limits.xǁKeyLimitsǁ_refuse*",
            "tierchain.limits.xǁKeyLimitsǁ_tokens*",
        ],
        # (not test_limits_hold.py: a warning it checks is logged once a process, and
        # mutmut runs the tests twice in one process before it mutates)
        [
            "tests/test_limits_admission.py",
            "tests/test_limits_counting.py",
            "tests/test_limits_windows.py",
            "tests/test_limits.py",
        ],
    ),
    "breaker-ledgers": (
        "src/tierchain/breaker_state.py",
        [
            "tierchain.breaker_state.x_reopen_cooldown*",
            "tierchain.breaker_state.x_failure_wait*",
            "tierchain.breaker_state.x__settle_time*",
            "tierchain.breaker_state.x_acquire*",
            "tierchain.breaker_state.x_record*",
            "tierchain.breaker_state.x_snapshot*",
        ],
        ["tests/test_breaker_ledger.py", "tests/test_breaker_model.py"],
    ),
    "hedging": (
        "src/tierchain/failover/hedging.py",
        [
            "tierchain.failover.hedging.x_hedged_by_default*",
            "tierchain.failover.hedging.x_may_hedge*",
            "tierchain.failover.hedging.xǁHedgingǁchecked*",
            "tierchain.failover.hedging.xǁHedgingǁbuild*",
            "tierchain.failover.hedging.xǁHedgingǁmay_hedge*",
            "tierchain.failover.hedging.xǁHedgingǁarm*",
            "tierchain.failover.hedging.xǁRaceǁ_due*",
        ],
        ["tests/test_hedging_rules.py"],
    ),
    "plan": (
        "src/tierchain/failover/plan.py",
        [
            "tierchain.failover.plan.x_next_attempt*",
            "tierchain.failover.plan.x_retry_pause*",
            "tierchain.failover.plan.x_may_retry*",
            "tierchain.failover.plan.x_record*",
            "tierchain.failover.plan.x_failed*",
            "tierchain.failover.plan.x__holds*",
        ],
        ["tests/test_failover_plan.py"],
    ),
    "watchdog": (
        "src/tierchain/watchdog.py",
        ["tierchain.watchdog.x*"],
        ["tests/test_watchdog.py"],
    ),
    "watch": (  # one attempt's timer: the windows, the stall gap, the reserve, the ceiling
        "src/tierchain/watch.py",
        [
            "tierchain.watch.xǁWatchǁbegin*",
            "tierchain.watch.xǁWatchǁfirst_data*",
            "tierchain.watch.xǁWatchǁanswered*",
            "tierchain.watch.xǁWatchǁ_deadline*",
            "tierchain.watch.xǁWatchǁ_due*",
            "tierchain.watch.xǁWatchǁ_end*",
            "tierchain.watch.xǁWatchǁ_schedule*",
            "tierchain.watch.xǁWatchǁ_quiet_since*",
            "tierchain.watch.xǁWatchǁ_expired*",
        ],
        [
            "tests/test_watch_windows.py",
            "tests/test_watch_status.py",
            "tests/test_decode.py",
            "tests/test_watchdog.py",
        ],
    ),
    "verdicts": (
        "src/tierchain/verdicts.py",
        ["tierchain.verdicts.x*"],
        ["tests/test_watch_verdicts.py", "tests/test_decode.py"],
    ),
    "continuation-seam": (
        "src/tierchain/formats/seam.py",
        [
            "tierchain.formats.seam.x_tokens*",
            "tierchain.formats.seam.x__limit*",
            "tierchain.formats.seam.xǁSeamǁrequest*",
            "tierchain.formats.seam.xǁSeamǁ_limited*",
            "tierchain.formats.seam.xǁSeamǁ_build*",
            "tierchain.formats.seam.xǁSeamǁsplice*",
            "tierchain.formats.seam.xǁSeamǁfinish*",
            "tierchain.formats.seam.xǁSeamǁ_through_seam*",
            "tierchain.formats.seam.xǁSeamǁ_decide*",
            "tierchain.formats.seam.xǁSeamǁ_tail_repeat*",
            "tierchain.formats.seam.xǁSeamǁ_release*",
        ],
        ["tests/test_seam_rules.py", "tests/test_continuation_seam.py"],
    ),
}


def mutate(target: str, python: str) -> int:
    """mutmut over MUTATE[target] in a scratch copy: the score and the survivors."""
    if target not in MUTATE:
        print(f"targets: {' | '.join(MUTATE)}")
        return 2
    path, names, tests = MUTATE[target]
    scratch = ROOT / ".mutants" / target
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for part in ("src", "tests", "docs", "examples", "bench"):
        shutil.copytree(ROOT / part, scratch / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "README.md", scratch / "README.md")
    # The [tool.mutmut] table of pyproject.toml, with this target's file and tests.
    config = (ROOT / "pyproject.toml").read_text()
    paths = [path] if isinstance(path, str) else path
    config = re.sub(r"(?m)^only_mutate = \[\]$", f"only_mutate = {json.dumps(paths)}", config)
    config = re.sub(
        r"(?m)^pytest_add_cli_args_test_selection = \[\]$",
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        config,
    )
    (scratch / "pyproject.toml").write_text(config)
    run = [python, "-m", "mutmut"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    code = subprocess.call([*run, "run", "--max-children", "1", *names], cwd=scratch, env=env)
    if code:
        return code
    out = subprocess.run(
        [*run, "results", "--all", "true"], cwd=scratch, env=env, capture_output=True, text=True
    ).stdout
    status: dict[str, str] = {}
    for line in out.splitlines():
        name, _, state = line.strip().rpartition(": ")
        if any(fnmatch.fnmatchcase(name, n) for n in names):
            status[name] = state
    tested = [n for n, s in status.items() if s not in ("no tests", "skipped", "not checked")]
    killed = [n for n in tested if status[n] in ("killed", "timeout")]
    survived = sorted(n for n in tested if n not in killed)
    for name in survived:
        subprocess.call([*run, "show", name], cwd=scratch, env=env)
    score = 100.0 * len(killed) / len(tested) if tested else 0.0
    untested = len(status) - len(tested)
    print(
        f"\n{target}: {len(killed)} of {len(tested)} mutants killed ({score:.1f} %), "
        f"{len(survived)} survived, {untested} in code no selected test runs"
    )
    return 0


def test(rest: list[str], env: dict[str, str]) -> int:
    """The whole suite: the tests that may share the machine on three workers at once (on
    two cores: many of them wait on sockets and real servers part of the time), then those
    marked ``alone`` (they measure real time or load real servers) by themselves. With
    arguments, pytest runs once with them."""
    pytest = [str(PY), "-m", "pytest"]
    if rest:
        return subprocess.call([*pytest, *rest], cwd=ROOT, env=env)
    shared = subprocess.call([*pytest, "-n", "3", "-m", "not alone"], cwd=ROOT, env=env)
    alone = subprocess.call([*pytest, "-m", "alone"], cwd=ROOT, env=env)
    return shared or alone


def main(argv: list[str]) -> int:
    commands = {"demo", "test", "bench", "instructions", "soak", "lint", "docs", "mutate"}
    if not argv or argv[0] not in commands:
        print(__doc__)
        print("commands: demo | test | bench | instructions | soak | lint | docs | mutate")
        return 2
    cmd, rest = argv[0], argv[1:]
    _ensure_venv()
    if cmd == "mutate":
        if len(rest) != 1:
            print(f"python3 dev.py mutate TARGET, one of: {' | '.join(MUTATE)}")
            return 2
        return mutate(rest[0], str(PY))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cmd == "demo":
        return subprocess.call([str(PY), "-m", "tierchain", "demo", *rest], env=env)
    if cmd == "test":
        return test(rest, env)
    if cmd == "bench":
        return subprocess.call([str(PY), str(ROOT / "bench" / "overhead.py"), *rest], env=env)
    if cmd == "instructions":
        script = ROOT / "bench" / "instructions.py"
        return subprocess.call([str(PY), str(script), *rest], env=env)
    if cmd == "soak":
        return subprocess.call([str(PY), str(ROOT / "bench" / "soak.py"), *rest], env=env)
    if cmd == "docs":
        return subprocess.call([str(PY), "-m", "mkdocs", "build", "--strict", *rest], cwd=ROOT)
    steps = [
        [str(PY), "-m", "ruff", "check", "src", "tests", "examples", "bench"],
        [str(PY), "-m", "ruff", "format", "--check", "src", "tests", "examples", "bench"],
        [str(PY), "-m", "mypy"],
    ]
    return max(subprocess.call(step, cwd=ROOT) for step in steps)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
