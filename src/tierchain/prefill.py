"""Does a backend continue a trailing assistant message? Found out, and remembered.

A continuation is best sent as a *prefill*: the partial answer as the last message,
the model's own continuation point. Asked in words instead ("Your previous answer was
cut off..."), a small model restarts the answer or ends it early. Which backends take a
prefill, without the operator having to know (:class:`Prefills`, one per Failover):

1. ``Backend(prefill=True/False)``: the operator's word, always.
2. What the store remembers of it (``fact_get(backend, "prefill")``): what was found
   out before, in this process or another sharing a RedisStore, or the recorded
   outcome of a prefilled continuation (a 400, ``prefill_rejected``: no; a whole
   continuation: yes).
3. The wire format's own word (``WireFormat.prefill``, in its module of
   :mod:`tierchain.formats`): ``native`` for Anthropic Messages and Ollama's
   ``/api/chat``; ``never`` for OpenAI Responses (no server is known to continue a
   trailing assistant item: asked in words) and plain; ``ask`` for OpenAI chat:
4. For ``ask``, the server is asked what it is, once (each GET bounded by
   ``probe_timeout``, and by the time left), and the answer remembered for ``ttl``:

   - ``GET /version``: llama.cpp's server answers everything with ``Server: llama.cpp``
     (its HTTP library's default header), and continues a trailing assistant message
     unless started with ``--no-prefill-assistant``: a prefill, nothing added. A
     ``{"version": ...}`` body is vLLM's (or SGLang's): a prefill with
     ``"continue_final_message": true, "add_generation_prompt": false`` added (vLLM
     refuses the first without the second).
   - ``GET /api/version`` answering ``{"version": ...}``: Ollama, whose OpenAI endpoint
     goes through its chat, which continues a trailing assistant message: a prefill.
   - Anything else (a hosted API's 404 or 401): asked in words. A server that does not
     answer in time is not remembered: asked again at the next continuation.

Nothing here runs on a healthy request: only when a committed stream broke and the next
tier is asked to finish it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from . import _json, formats
from ._connections import trust_store
from ._runtime import clock
from .backend import Backend
from .store import FactStore, MemoryStore
from .telemetry import log_event

__all__ = ["FACT", "SERVERS", "Prefill", "Prefills"]

FACT = "prefill"
"""The name of the fact in the store (``fact_get(backend, FACT)``)."""

_CONTINUE_FINAL = {"continue_final_message": True, "add_generation_prompt": False}

SERVERS: Mapping[str, Mapping[str, Any]] = {
    "llama.cpp": {},
    "vllm": _CONTINUE_FINAL,
    "ollama": {},
}
"""The servers known to continue a trailing assistant message on their OpenAI chat
endpoint, and what the request gains for each."""

_SIZE = 64 * 1024  # the most of a probe's answer read


@dataclass(frozen=True, slots=True)
class Prefill:
    """Whether to send a continuation as a prefill (``takes``), the fields the request
    gains (``adds``), the server found (``server``) and who said so (``source``:
    ``operator``, ``format``, ``server``, ``recorded``)."""

    takes: bool
    source: str
    server: str | None = None
    adds: Mapping[str, Any] = field(default_factory=dict)


def _known(value: str | None) -> Prefill | None:
    """A fact as the store keeps it, or None (none, or not one of ours)."""
    if value is None:
        return None
    try:
        data = _json.loads(value)
        takes, server, source = bool(data["takes"]), data.get("server"), str(data["source"])
    except (ValueError, TypeError, KeyError):
        return None
    server = server if isinstance(server, str) else None
    adds = SERVERS.get(server or "", {}) if takes else {}
    return Prefill(takes, source, server, adds)


class Prefills:
    """Whether each backend continues a trailing assistant message: see the module
    docstring. ``store``: a :class:`~tierchain.store.FactStore` (Failover's store; else
    this process's own); ``ttl``: how long a fact is remembered."""

    def __init__(
        self, store: Any = None, *, probe_timeout: float = 1.0, ttl: float = 86400.0
    ) -> None:
        self.store: FactStore = store if isinstance(store, FactStore) else MemoryStore()
        self.probe_timeout = probe_timeout
        self.ttl = ttl

    async def for_backend(
        self, backend: Backend, wire: str | None, *, limit: float | None = None
    ) -> Prefill:
        """Whether to prefill a continuation sent to ``backend`` in ``wire`` (``limit``:
        the most seconds a question to the server may take)."""
        if backend.prefill is not None:
            return Prefill(backend.prefill, "operator")
        try:
            known = _known(await self.store.fact_get(backend.name, FACT))
        except Exception as exc:  # a store must never fail a request
            log_event("continuation.prefill_store_failed", level=logging.WARNING, error=repr(exc))
            known = None
        if known is not None:
            return known
        rule = formats.of(wire).prefill  # the format's own word, or "ask" the server
        if rule != "ask":
            return Prefill(rule == "native", "format")
        timeout = self.probe_timeout if limit is None else min(self.probe_timeout, limit)
        if timeout <= 0:
            return Prefill(False, "format")
        found = await self._ask(backend, timeout)
        if found is None:
            return Prefill(False, "format")  # no answer: asked again next time
        await self._remember(backend.name, found)
        return found

    async def recorded(self, backend: Backend, prefill: Prefill, *, taken: bool) -> None:
        """The outcome of a continuation sent to ``backend`` as ``prefill`` said: a 400
        (``taken`` False) or a whole continuation (True). Remembered when it changes what
        is known (never over the operator's word)."""
        if not prefill.takes or prefill.source == "operator":
            return
        if taken and prefill.source in ("server", "recorded"):
            return  # already known
        server = prefill.server if taken else None
        await self._remember(backend.name, Prefill(taken, "recorded", server))

    async def _remember(self, name: str, found: Prefill) -> None:
        value = json.dumps(
            {"takes": found.takes, "server": found.server, "source": found.source},
            separators=(",", ":"),
        )
        try:
            await self.store.fact_put(name, FACT, value, self.ttl)
        except Exception as exc:  # a store must never fail a request
            log_event("continuation.prefill_store_failed", level=logging.WARNING, error=repr(exc))
        log_event(
            "continuation.prefill_found",
            backend=name,
            takes=found.takes,
            server=found.server,
            source=found.source,
        )

    async def _ask(self, backend: Backend, within: float) -> Prefill | None:
        """The server's own word (None: it did not answer in time)."""
        base = backend.url.split("?", 1)[0].rstrip("/")
        deadline = clock.now() + within
        # A client of its own: asked once a backend and a day, nothing kept open.
        async with httpx.AsyncClient(
            follow_redirects=False, trust_env=False, verify=trust_store()
        ) as client:
            return await self._asked(client, base, deadline)

    async def _asked(self, client: httpx.AsyncClient, base: str, deadline: float) -> Prefill | None:
        answer = await _get(client, base + "/version", deadline - clock.now())
        if answer is None:
            return None
        headers, status, body = answer
        if headers.get("server", "").lower().startswith("llama.cpp"):
            return Prefill(True, "server", "llama.cpp")
        if status == 200 and _has_version(body):
            return Prefill(True, "server", "vllm", _CONTINUE_FINAL)
        left = deadline - clock.now()
        answer = await _get(client, base + "/api/version", left) if left > 0 else None
        if answer is not None and answer[1] == 200 and _has_version(answer[2]):
            return Prefill(True, "server", "ollama")
        return Prefill(False, "server")


async def _get(
    client: httpx.AsyncClient, url: str, within: float
) -> tuple[httpx.Headers, int, bytes] | None:
    """One GET of ``url`` within ``within`` seconds: its headers, status and (the first
    64 KiB of) its body, or None when it did not answer."""
    try:
        async with (
            asyncio.timeout(within),
            client.stream("GET", url, timeout=within) as response,
        ):
            body = b""
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > _SIZE:
                    break
            return response.headers, response.status_code, body
    except (httpx.HTTPError, OSError, TimeoutError):
        return None


def _has_version(body: bytes) -> bool:
    try:
        data = _json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("version"), str)
