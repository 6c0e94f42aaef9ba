from __future__ import annotations

import pytest
from prometheus_client import REGISTRY


@pytest.fixture
def metric():
    """Read a tierchain metric sample from the default registry (0.0 when absent)."""

    def read(name: str, **labels: str) -> float:
        value = REGISTRY.get_sample_value(name, labels)
        return 0.0 if value is None else value

    return read


@pytest.fixture
async def browser():
    """A headless Chromium (Playwright Browser); skips where it cannot be had."""
    from .browser import launch

    try:
        async with launch() as b:
            yield b
    except LookupError as exc:
        pytest.skip(f"headless Chromium unavailable: {exc}")
