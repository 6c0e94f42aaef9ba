"""CallerKeys: no key, no route; and per key, who may steer toward which backend.

``tierchain serve`` puts it in front of the routed stack when
``TIERCHAIN_API_KEYS`` or ``TIERCHAIN_API_KEYS_FILE`` is set (inside the health,
readiness, metrics and model-list endpoints, which stay open, and outside Shed).
A request presents its key the way the SDKs send one: ``Authorization: Bearer
<key>`` (OpenAI) or ``x-api-key: <key>`` (Anthropic; ``api-key`` for Azure
OpenAI clients). Without one, or with one that is not configured, it gets
``401`` with a JSON error (``authentication_error``, ``missing_key`` or
``unknown_key``; in Ollama's ``{"error": "..."}`` shape on ``/api/*``, OpenAI's
elsewhere) and nothing behind runs, except under ``open_paths``.

Per key:

- ``prefer``: whether the caller's ``X-Prefer-Backend`` header is honoured.
  Without it the header is removed before PreferBackend sees it, so a caller
  cannot move itself up to a paid tier.
- ``backend``: the backend its requests go to first, as if it had sent
  ``X-Prefer-Backend: <backend>`` (reorder, never filter: the rest of the
  chain stays behind it).
- ``priority``: whether its requests may name a waiting-room band above the
  middle one (Failover's ``priority_header``); without it a key may only lower
  itself.

Per key, limits (enforced by :class:`tierchain.limits.KeyLimits`, which
``tierchain serve`` puts right behind this layer, to count every key's usage):
``rpm`` and ``tpm`` (requests and tokens per minute), ``budget_tokens`` per
``budget_period``, ``max_parallel`` requests in flight, and ``default_max_tokens``
(the output a request that names none reserves). The matched key is left in the scope under
:data:`CALLER_KEY` for the layers behind (None for a request let through on an
open path).

Every configured key (the one presented and any other) is removed before the
request goes on, whichever carrier holds it: each header field whose value holds
one (``Authorization``, also as ``Basic`` credentials, ``x-api-key``,
``api-key``, or any other header; every one of them, not only the first) and
each query parameter that holds one (``?api_key=``, ``?key=``, percent-encoded
or not), on an open path too. A gateway key is never forwarded, not even to a
backend with ``forward_caller_auth``. Keys are compared in constant time (SHA-256 digests
through :func:`hmac.compare_digest`, every configured key each time); they are
registered with the masker (:func:`tierchain.masking.hide`), so no log line,
error or ``check-config`` output shows one; a log line names the key's
``name``, never the key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import tomllib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_to_bytes

from ._checks import count, duration, parse_duration
from ._head import refuse_request
from ._target import BadTarget, request_target
from ._types import ASGIApp, Receive, Scope, Send
from .masking import hide

__all__ = [
    "CALLER_KEY",
    "CallerKey",
    "CallerKeys",
    "caller_name",
    "key_list",
    "load_keys_file",
    "may_jump",
]

CALLER_KEY = "tierchain.caller_key"
"""The scope key under which :class:`CallerKeys` leaves the matched :class:`CallerKey`
(None: a request without a key let through on an open path)."""

_KEY = re.compile(r"[\x21-\x7e]{16,512}")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_CARRIERS = (b"authorization", b"x-api-key", b"api-key")
_CHALLENGE = [(b"www-authenticate", b'Bearer realm="tierchain"')]
_LIMITS = ("rpm", "tpm", "budget_tokens", "budget_period", "max_parallel", "default_max_tokens")


@dataclass(frozen=True, slots=True)
class CallerKey:
    """One caller key: its ``name`` (shown in logs), the ``key`` itself, and what it may do."""

    name: str
    key: str = field(repr=False)
    prefer: bool = False
    backend: str | None = None
    priority: bool = False
    """May name a waiting-room priority band above the middle one (see Failover)."""
    rpm: int | None = None
    """Requests per minute (a sliding minute); None: no limit."""
    tpm: int | None = None
    """Tokens per minute (input and output, as the backends report them); None: no limit."""
    budget_tokens: int | None = None
    """Tokens per ``budget_period``; None: no budget."""
    budget_period: float = 86400.0
    """The budget's sliding period in seconds (default a day)."""
    max_parallel: int | None = None
    """Requests of this key in flight at once, across replicas (LiteLLM's
    ``max_parallel_requests``); None: no limit."""
    default_max_tokens: int | None = None
    """The output tokens reserved for a request that names no ``max_tokens`` (None:
    KeyLimits' ``default_max_tokens``)."""

    @property
    def limited(self) -> bool:
        """True when the key has a rate limit, a budget or a cap on requests in flight."""
        return (
            self.rpm is not None
            or self.tpm is not None
            or self.budget_tokens is not None
            or self.max_parallel is not None
        )

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"a key name is 1-64 of A-Z a-z 0-9 . _ -, got {self.name!r}")
        if not _KEY.fullmatch(self.key) or "," in self.key:
            raise ValueError(
                f"key {self.name!r} must be 16 to 512 printable ASCII characters, "
                "no spaces or commas"
            )
        if self.backend is not None and not _NAME.fullmatch(self.backend):
            raise ValueError(f"key {self.name!r}: backend must be a backend name")
        for limit in ("rpm", "tpm", "budget_tokens", "max_parallel"):
            count(f"key {self.name!r}: {limit}", getattr(self, limit), allow_none=True)
        count(
            f"key {self.name!r}: default_max_tokens",
            self.default_max_tokens,
            minimum=0,
            allow_none=True,
        )
        period = duration(f"key {self.name!r}: budget_period", self.budget_period, at_least=60.0)
        object.__setattr__(self, "budget_period", period)  # a timedelta, as seconds


def key_list(raw: str) -> tuple[CallerKey, ...]:
    """``TIERCHAIN_API_KEYS``: keys separated by commas, named ``key-1``, ``key-2``, ...

    They may use the routes, but not ``X-Prefer-Backend``; give a key more in a keys file.
    """
    pieces = [p.strip() for p in raw.split(",") if p.strip()]
    if not pieces:
        raise ValueError("no key given")
    return tuple(CallerKey(f"key-{i}", p) for i, p in enumerate(pieces, 1))


def load_keys_file(path: str, environ: Mapping[str, str] | None = None) -> tuple[CallerKey, ...]:
    """A TOML file of ``[[keys]]`` tables: ``name``, ``key`` or ``key_env``, ``prefer``,
    ``backend``, ``priority``, ``rpm``, ``tpm``, ``budget_tokens``, ``budget_period`` (a
    duration such as ``"1d"``), ``max_parallel``, ``default_max_tokens``. ``key_env`` names
    the variable that holds the key."""
    env = os.environ if environ is None else environ
    with open(path, "rb") as f:
        data = tomllib.load(f)
    tables = data.get("keys")
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"{path}: expected one or more [[keys]] tables")
    keys = []
    for n, table in enumerate(tables, 1):
        if not isinstance(table, dict):
            raise ValueError(f"{path}: [[keys]] entry {n} is not a table")
        unknown = set(table) - {"name", "key", "key_env", "prefer", "backend", "priority", *_LIMITS}
        if unknown:
            raise ValueError(f"{path}: [[keys]] entry {n} has unknown fields {sorted(unknown)}")
        name = table.get("name", f"key-{n}")
        key = table.get("key")
        if key is None and "key_env" in table:
            key = env.get(str(table["key_env"]))
            if key is None:
                raise ValueError(f"{path}: key {name!r}: {table['key_env']} is not set")
        if not isinstance(key, str):
            raise ValueError(f"{path}: key {name!r} needs key or key_env")
        prefer = table.get("prefer", False)
        if not isinstance(prefer, bool):
            raise ValueError(f"{path}: key {name!r}: prefer must be true or false")
        priority = table.get("priority", False)
        if not isinstance(priority, bool):
            raise ValueError(f"{path}: key {name!r}: priority must be true or false")
        limits = {k: table[k] for k in _LIMITS if k in table}
        if isinstance(limits.get("budget_period"), str):
            try:
                limits["budget_period"] = parse_duration(limits["budget_period"])
            except ValueError as exc:
                raise ValueError(f"{path}: key {name!r}: budget_period: {exc}") from None
        try:
            keys.append(
                CallerKey(str(name), key, prefer, table.get("backend"), priority=priority, **limits)
            )
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    names = [k.name for k in keys]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: key names must differ")
    return tuple(keys)


class CallerKeys:
    """Answer ``401`` to a request without a configured key; apply the key's steering.

    ``keys``: :class:`CallerKey` objects (or plain key strings, which may route but
    not steer). ``keys_file``: a TOML file of more (see :func:`load_keys_file`).
    ``header``: PreferBackend's header (``X-Prefer-Backend``). ``open_paths``: path
    prefixes (``/api/``) where a request without a valid key goes on all the same,
    as the anonymous caller (its own headers untouched; one shared share of the
    waiting room, no priority); a valid key there counts as anywhere else.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: Iterable[CallerKey | str] = (),
        keys_file: str | None = None,
        header: str = "X-Prefer-Backend",
        open_paths: Collection[str] = (),
    ) -> None:
        self.app = app
        if isinstance(open_paths, str) or not all(
            isinstance(p, str) and p.startswith("/") for p in open_paths
        ):
            raise ValueError(
                f"open_paths must be path prefixes starting with /, got {open_paths!r}"
            )
        self.open_paths = tuple(p.encode() for p in open_paths)
        given = [
            k if isinstance(k, CallerKey) else CallerKey(f"key-{i}", k)
            for i, k in enumerate(keys, 1)
        ]
        if keys_file is not None:
            given.extend(load_keys_file(keys_file))
        if not given:
            raise ValueError("CallerKeys needs at least one key (keys= or keys_file=)")
        if self.open_paths:
            _refuse_open_paths_with_limits(app, given)
        self.header = header.lower().encode("latin-1")
        self._keys = tuple((hashlib.sha256(k.key.encode()).digest(), k) for k in given)
        self._strip = _Strip(k.key for k in given)
        for key in given:
            hide(key.key)

    def __repr__(self) -> str:
        return f"CallerKeys(keys=[{', '.join(k.name for _, k in self._keys)}])"

    def _open(self, scope: Scope) -> bool:
        """Is the request's (checked, normalised) path under one of ``open_paths``?"""
        try:
            path = request_target(scope).path
        except BadTarget:
            return False
        return path.startswith(self.open_paths)

    def match(self, presented: bytes) -> CallerKey | None:
        """The configured key equal to ``presented`` (every key compared, in constant time)."""
        digest = hashlib.sha256(presented).digest()
        found: CallerKey | None = None
        for known, key in self._keys:
            if hmac.compare_digest(known, digest):
                found = key
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        presented, _ = _presented(headers)
        key = None if presented is None else self.match(presented)
        if key is None and self.open_paths and self._open(scope):
            self._strip.scope(scope)  # (another caller's key never travels with it)
            scope[CALLER_KEY] = None  # the anonymous caller
            return await self.app(scope, receive, send)
        if presented is None:
            return await refuse_request(
                scope,
                send,
                401,
                "this gateway needs an API key: send it as Authorization: Bearer <key>",
                "missing_key",
                type="authentication_error",
                headers=_CHALLENGE,
            )
        if key is None:
            return await refuse_request(
                scope,
                send,
                401,
                "the API key is not valid for this gateway",
                "unknown_key",
                type="authentication_error",
                headers=_CHALLENGE,
            )
        prefer = self.header
        kept = [(k, v) for k, v in headers if key.prefer or k != prefer]
        if key.backend is not None and not any(k == prefer for k, _ in kept):
            kept.append((prefer, key.backend.encode()))
        scope["headers"] = kept
        self._strip.scope(scope)
        scope[CALLER_KEY] = key
        await self.app(scope, receive, send)


def _refuse_open_paths_with_limits(app: ASGIApp, keys: Iterable[CallerKey]) -> None:
    """``open_paths`` in front of a layer that limits per key (``KeyLimits``), with a limit
    to hold: a request without a key would pass every limit, so refuse to be built."""
    layer: object = app
    for _ in range(64):  # (the layers a stack can hold; a loop of .app ends here)
        if layer is None:
            return
        if getattr(layer, "limits_per_key", False):
            limited = [k.name for k in keys if k.limited]
            if limited or getattr(layer, "budgets", None):
                what = f"keys {limited} have limits" if limited else "it has backend budgets"
                raise ValueError(
                    f"open_paths cannot stand in front of KeyLimits while {what}: a request "
                    "without a key on an open path has no key to limit or count; drop "
                    "open_paths or the limits"
                )
            return
        layer = getattr(layer, "app", None)


def caller_name(scope: Scope) -> str | None:
    """The name of the caller key the request presented (None: no CallerKeys in front)."""
    if CALLER_KEY not in scope:
        return None
    key = scope[CALLER_KEY]
    return key.name if isinstance(key, CallerKey) else ""


def may_jump(scope: Scope) -> bool:
    """May this request name a waiting-room band above the middle one? Only with a key
    that has ``priority`` (or with no CallerKeys in front)."""
    if CALLER_KEY not in scope:
        return True
    key = scope[CALLER_KEY]
    return isinstance(key, CallerKey) and key.priority


class _Strip:
    """Every configured key out of a request's headers and query string, whichever carries it.

    One pattern of every key (longest first); a request whose header values, query
    string (as sent and percent-decoded) and ``Basic`` credentials (base64-decoded)
    hold none is left as it is after one search. Otherwise each header field that
    holds a key is dropped whole, and each query parameter that holds one. It runs
    once the caller is let through, after the constant-time match.
    """

    def __init__(self, keys: Iterable[str]) -> None:
        self._find = re.compile(_trie({k.encode() for k in keys})).search

    def _holds(self, name: bytes, value: bytes) -> bool:
        if self._find(value):
            return True
        scheme, _, rest = value.partition(b" ")
        return (
            name == b"authorization"
            and scheme.lower() == b"basic"
            and bool(self._find(_unbase64(rest.strip())))
        )

    def scope(self, scope: Scope) -> None:
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        query: bytes = scope.get("query_string", b"")
        find = self._find
        blob = b"\n".join([v for _, v in headers])
        if (
            find(blob) is None
            and b"asic " not in blob  # (no Basic credentials to decode)
            and not (query and (find(query) or find(_unquoted(query))))
        ):
            return
        scope["headers"] = [(k, v) for k, v in headers if not self._holds(k.lower(), v)]
        if query:
            pairs = [p for p in query.split(b"&") if p and not (find(p) or find(_unquoted(p)))]
            kept = b"&".join(pairs)
            if kept != query:
                scope["query_string"] = kept
                raw_path = scope.get("raw_path")
                if raw_path is not None and b"?" in raw_path:
                    scope["raw_path"] = raw_path.partition(b"?")[0]


def _trie(keys: Collection[bytes]) -> bytes:
    """One pattern matching any of ``keys``, as a trie (``ab(?:c|d)``): the regex engine
    tries the keys that share a first byte together, not every key at every position."""
    root: dict[int, Any] = {}
    for key in keys:
        node = root
        for byte in key:
            node = node.setdefault(byte, {})
        node[-1] = {}  # a key ends here

    def emit(node: dict[int, Any]) -> bytes:
        alternatives = [re.escape(bytes([b])) + emit(node[b]) for b in sorted(node) if b >= 0]
        if not alternatives:
            return b""
        if len(alternatives) == 1 and -1 not in node:
            return alternatives[0]
        group = b"(?:" + b"|".join(alternatives) + b")"
        return group + b"?" if -1 in node else group

    return emit(root)


def _unquoted(text: bytes) -> bytes:
    return unquote_to_bytes(text.replace(b"+", b" "))


def _unbase64(text: bytes) -> bytes:
    try:
        return base64.b64decode(text, validate=False)
    except ValueError:
        return b""


def _presented(headers: Iterable[tuple[bytes, bytes]]) -> tuple[bytes | None, bytes | None]:
    """The key a request presents, and the header it came in."""
    for name, value in headers:
        if name in _CARRIERS:
            if name == b"authorization":
                scheme, _, rest = value.partition(b" ")
                if scheme.lower() != b"bearer" or not rest.strip():
                    continue
                return rest.strip(), name
            if value.strip():
                return value.strip(), name
    return None, None
