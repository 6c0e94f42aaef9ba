"""docs/api.md lists every public name, and its docstrings' roles render as Markdown."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

import tierchain

from .support import load_script

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "api.md"


def test_every_public_name_has_an_entry_on_the_api_page():
    entries = re.findall(r"^::: tierchain\.(\w+)$", PAGE.read_text(), re.M)
    public = [name for name in tierchain.__all__ if name != "__version__"]
    missing = [name for name in public if name not in entries]
    assert not missing, f"docs/api.md has no '::: tierchain.<name>' line for {missing}"
    assert len(entries) == len(set(entries)), "a name is listed twice"
    modules = {name for name in entries if isinstance(getattr(tierchain, name, None), ModuleType)}
    assert modules == {"request"}  # its docstring, which TierRequest's refers to
    assert set(entries) - modules <= set(public), set(entries) - modules - set(public)
    assert "`tierchain.__version__`" in PAGE.read_text()


def test_the_api_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in ("api.md", "internals.md", "contributing.md"):
        assert re.search(rf"^  - [^:]+: {page}$", nav, re.M), page
        assert f"docs/{page}" in (ROOT / "README.md").read_text(), page


def roles_extension():
    pytest.importorskip("griffe")
    path = ROOT / "docs" / "_ext" / "griffe_roles.py"
    return load_script(path, "griffe_roles")


def test_a_role_naming_a_public_name_becomes_a_link_to_its_entry():
    convert = roles_extension().rest_roles_to_markdown
    assert convert("a :class:`~tierchain.RedisStore` here") == (
        "a [`RedisStore`][tierchain.RedisStore] here"
    )
    assert convert(":class:`~tierchain.errors.BackendSkipped`") == (
        "[`BackendSkipped`][tierchain.BackendSkipped]"
    )
    assert convert(":meth:`RedisStore.set_pin <tierchain.RedisStore.set_pin>`") == (
        "[`RedisStore.set_pin`][tierchain.RedisStore]"
    )


def test_a_role_naming_anything_else_becomes_plain_code():
    convert = roles_extension().rest_roles_to_markdown
    assert convert(":class:`~tierchain.observer.Observer`") == "`Observer`"
    assert convert(":func:`tierchain.config.from_env`") == "`tierchain.config.from_env`"
    assert convert(":mod:`logging`") == "`logging`"
    assert convert("no role, ``code``") == "no role, ``code``"
