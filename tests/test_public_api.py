"""The names users import from the top of the package, and the exception tree they catch."""

from __future__ import annotations

import pytest

import tierchain
from tierchain import errors


def test_every_name_in_all_is_importable_from_the_top():
    for name in tierchain.__all__:
        assert getattr(tierchain, name) is not None, name


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("ResolveError", ValueError),
        ("StoreUnavailable", ConnectionError),
        ("ConfigError", ValueError),
    ],
)
def test_the_exceptions_users_catch_are_exported_and_drawn_in_the_tree(name, builtin):
    cls = getattr(tierchain, name)
    assert name in tierchain.__all__
    assert issubclass(cls, tierchain.TierchainError)
    assert issubclass(cls, builtin)  # code that caught the built-in base still does
    assert f"── {name}" in (errors.__doc__ or "")


def test_the_old_import_paths_of_the_exceptions_still_work():
    from tierchain.config import ConfigError
    from tierchain.failover import ResolveError
    from tierchain.redis_store import StoreUnavailable

    assert ConfigError is tierchain.ConfigError
    assert ResolveError is tierchain.ResolveError
    assert StoreUnavailable is tierchain.StoreUnavailable


def test_every_exception_in_errors_is_drawn_in_its_tree():
    drawn = errors.__doc__ or ""
    for name in errors.__all__:
        assert name in drawn, name


def test_admin_keeps_its_import_path_as_a_package():
    from tierchain.admin import Admin

    assert Admin is tierchain.Admin
    assert Admin.__module__ == "tierchain.admin.app"
