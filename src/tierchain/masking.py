"""Secrets out of URLs and messages, before anything is printed or logged.

Every URL tierchain prints or logs (``check-config``, the identity line, log
events, error bodies, ``repr()``) goes through :func:`mask_url`:

- userinfo (``user:password@``) becomes ``***@``;
- the value of every query parameter whose name sounds secret (``password``,
  ``key``, ``api_key``, ``token``, ``secret``, ``auth``, ``sig``, ...) becomes
  ``***``, and so does a parameter that is a bare value (no ``=``);
- a fragment becomes ``***`` (it is never sent anywhere, and a password with an
  unescaped ``#`` ends up there);
- a URL that does not parse (a password with an unescaped ``/``, a port that is
  not a number, no host) is masked from its text, erring towards hiding too
  much: everything before its last ``@`` becomes ``***``. So is a URL whose
  ``://`` is mistyped (``redis//:pw@host``, ``redis:/u:pw@host``) but that has
  an ``@``.

A message that may quote a URL (an exception's text) goes through
:func:`mask_text`, which hides every secret :func:`url_secrets` finds in the
URLs it is given, masks any URL written in the message itself, and hides every
secret registered with :func:`hide` (the caller keys of
:class:`~tierchain.keys.CallerKeys`).

The scheme, host, port and path are left as they are: they are what an
operator needs to tell one backend from another.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, unquote_plus, urlsplit

__all__ = ["MASK", "SECRET_NAME", "hide", "mask_text", "mask_url", "url_secrets"]

MASK = "***"

SECRET_NAME = re.compile(
    r"pass|pwd|secret|token|key|auth|credential|sig|session|cookie|jwt|bearer", re.IGNORECASE
)
"""Names (query parameters, option keys) whose values are secrets."""

_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
_MIN_PIECE = 3  # secrets shorter than this are not hunted for in messages
_HIDDEN: set[str] = set()


def hide(secret: str) -> None:
    """Mask ``secret`` wherever :func:`mask_text` runs from now on (a caller key)."""
    if len(secret) >= _MIN_PIECE:
        _HIDDEN.add(secret)


def hidden() -> bool:
    """True once a secret was registered with :func:`hide`."""
    return bool(_HIDDEN)


def _well_formed(url: str) -> bool:
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises for a port that is not a number
    except ValueError:
        return False
    if "://" in url and not parts.hostname:
        return False
    if "://" not in url and "@" in url:
        return False  # a mistyped scheme (redis//:pw@host): no authority to tell it by
    # An "@" after the authority means a password with a "/", "?" or "#" in it.
    tail = url.partition("://")[2]
    authority_end = min((i for i in (tail.find(c) for c in "/?#") if i >= 0), default=len(tail))
    return "@" not in tail[authority_end:]


def _split(url: str) -> tuple[str, str, str, str, str, str]:
    """(scheme + "://", userinfo, rest of the authority and path, query, fragment, sep) of ``url``.

    ``userinfo`` excludes its ``@``; ``sep`` is ``"@"`` when there was one.
    """
    scheme, sep, rest = url.partition("://")
    head = scheme + sep if sep else ""
    if not sep:
        rest = url
    userinfo, at = "", ""
    if _well_formed(url):
        end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
        cut = rest.rfind("@", 0, end)
    else:
        cut = rest.rfind("@")
    if cut >= 0:
        userinfo, at, rest = rest[:cut], "@", rest[cut + 1 :]
    rest, hash_, fragment = rest.partition("#")
    path, q, query = rest.partition("?")
    return head, userinfo, path, (q + query), (hash_ + fragment), at


def _params(query: str) -> list[tuple[str, str | None]]:
    """``a=1&b&c=3`` as [("a", "1"), ("b", None), ("c", "3")], the text kept as written."""
    out: list[tuple[str, str | None]] = []
    for piece in re.split(r"[&;]", query):
        name, eq, value = piece.partition("=")
        out.append((name, value if eq else None))
    return out


def _secret_param(name: str, value: str | None) -> bool:
    if value is None:
        return bool(name)
    return bool(value) and SECRET_NAME.search(unquote_plus(name)) is not None


def mask_url(url: str) -> str:
    """``url`` with its userinfo, secret query values and fragment replaced by ``***``."""
    head, userinfo, path, query, fragment, at = _split(url)
    if at:
        userinfo = MASK
    if query:
        seps = re.findall(r"[&;]", query[1:])
        masked = []
        for name, value in _params(query[1:]):
            if _secret_param(name, value):
                masked.append(f"{name}={MASK}" if value is not None else MASK)
            else:
                masked.append(name if value is None else f"{name}={value}")
        query = "?" + "".join(p + (seps[i] if i < len(seps) else "") for i, p in enumerate(masked))
    if fragment:
        fragment = "#" + MASK
    return f"{head}{userinfo}{at}{path}{query}{fragment}"


def url_secrets(url: str) -> tuple[str, ...]:
    """The pieces of ``url`` that :func:`mask_url` hides, as written and percent-decoded."""
    _, userinfo, _, query, fragment, at = _split(url)
    found: set[str] = set()
    if at and userinfo:
        found.add(userinfo)
        user, _, password = userinfo.partition(":")
        found.add(password or user)  # a user name alone is the credential (token@host)
        if not _well_formed(url):
            found.update(p for p in re.split(r"[:/?#@]", userinfo) if len(p) >= _MIN_PIECE)
    for name, value in _params(query[1:]) if query else ():
        if _secret_param(name, value):
            found.add(value if value is not None else name)
    if len(fragment) > 1:
        found.add(fragment[1:])
    decoded = {unquote(s) for s in found} | {unquote_plus(s) for s in found}
    return tuple(sorted((found | decoded) - {""}, key=len, reverse=True))


def mask_text(text: str, *urls: str | None) -> str:
    """``text`` with the secrets of ``urls``, and of any URL written in it, replaced by ``***``."""
    secrets: set[str] = set(_HIDDEN)
    for url in urls:
        if url:
            secrets.update(url_secrets(url))
    text = _URL_IN_TEXT.sub(lambda m: _mask_found(m.group(0), secrets), text)
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= _MIN_PIECE:
            text = text.replace(secret, MASK)
    return text


def _mask_found(url: str, secrets: set[str]) -> str:
    secrets.update(url_secrets(url))
    return mask_url(url)
