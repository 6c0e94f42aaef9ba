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
