"""Class docstrings are short summaries; each option is documented on the page they link.

For every public class that takes options (named ``__init__`` parameters besides ``app``), the
class docstring stays within ``MAX_LINES`` lines and links a page in docs/ (a relative Markdown
link, which renders in docs/api.md beside the pages), the link's anchor is a heading on that
page, and every ``__init__`` parameter appears there in backticks (`` `name` ``).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import tierchain

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MAX_LINES = 12
LINK = re.compile(r"\]\(([\w-]+\.md)(?:#([\w-]+))?\)")
# Made by tierchain, not configured by the caller: the exceptions (their docstrings say what
# their fields mean) and the per-request record that Failover fills in.
NOT_CONFIGURED = {"Attempt"}


def options(cls: type) -> list[str]:
    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        name
        for name, parameter in signature.parameters.items()
        if parameter.kind in named and name not in ("self", "app")
    ]


def configurable() -> list[str]:
    names = []
    for name in tierchain.__all__:
        obj = getattr(tierchain, name)
        if not inspect.isclass(obj) or issubclass(obj, BaseException):
            continue
        if name in NOT_CONFIGURED or not options(obj):
            continue
        names.append(name)
    return names


def anchors(text: str) -> set[str]:
    """The ids mkdocs' toc extension gives the page's headings."""
    slugs = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        slugs.add(re.sub(r"[\s-]+", "-", slug))
    return slugs


def test_the_check_covers_the_classes_that_take_options():
    names = configurable()
    for name in ("Failover", "Backend", "Breaker", "SaturationWatchdog", "Endpoints", "Admin"):
        assert name in names
    assert "Routes" in names
    assert "BackendBusy" not in names


@pytest.mark.parametrize("name", configurable())
def test_a_class_docstring_is_a_summary_that_links_its_options(name):
    cls = getattr(tierchain, name)
    doc = inspect.cleandoc(cls.__doc__ or "")
    lines = doc.splitlines()
    assert len(lines) <= MAX_LINES, f"{name}'s docstring has {len(lines)} lines"
    links = LINK.findall(doc)
    assert links, f"{name}'s docstring links no page in docs/"
    page, anchor = links[-1]
    path = DOCS / page
    assert path.is_file(), f"{name} links {page}, which is not in docs/"
    text = path.read_text()
    if anchor:
        assert anchor in anchors(text), f"{page} has no heading #{anchor}"
    missing = [option for option in options(cls) if f"`{option}`" not in text]
    assert not missing, f"{page} does not name {name}'s options {missing} in backticks"
