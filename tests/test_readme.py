"""The README's FastAPI example runs as written and stacks in the brief's order."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_gateway_builds_with_the_stack_in_the_briefs_order():
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    app = namespace["app"]
    layer = app.build_middleware_stack()
    order = []
    while layer is not None and len(order) < 20:
        order.append(type(layer).__name__)
        layer = getattr(layer, "app", None)
    ours = [
        name
        for name in order
        if name
        in {"Heartbeats", "Budget", "PreferBackend", "Failover", "Breaker", "SaturationWatchdog"}
    ]
    assert ours == [
        "Heartbeats",
        "Budget",
        "PreferBackend",
        "Failover",
        "Breaker",
        "SaturationWatchdog",
    ]
