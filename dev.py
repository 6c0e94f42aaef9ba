#!/usr/bin/env python3
"""The front door: `python3 dev.py demo` and `python3 dev.py test`.

Both create `.venv/` on first use (only Python 3.11+ is needed) and install
tierchain with its `dev` extra into it, then run inside it. Any further
arguments go to the command: `python3 dev.py test -k failover -x`.
"""

from __future__ import annotations

import hashlib
import os
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
    if sys.version_info < (3, 11):
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


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"demo", "test", "bench", "soak", "lint", "docs"}:
        print(__doc__)
        print("commands: demo | test | bench | soak | lint | docs")
        return 2
    cmd, rest = argv[0], argv[1:]
    _ensure_venv()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cmd == "demo":
        return subprocess.call([str(PY), "-m", "tierchain", "demo", *rest], env=env)
    if cmd == "test":
        return subprocess.call([str(PY), "-m", "pytest", *rest], cwd=ROOT, env=env)
    if cmd == "bench":
        return subprocess.call([str(PY), str(ROOT / "bench" / "overhead.py"), *rest], env=env)
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
