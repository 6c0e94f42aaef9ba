"""ASGI type aliases of our own, so that no framework is a runtime dependency.

Why not ``asgiref.typing``: its ``Scope`` and message types are unions of
TypedDicts, and a TypedDict is not a ``MutableMapping`` to mypy. Tried one
alias at a time under ``mypy --strict`` over ``src/``, taking ``ASGIApp`` from
``asgiref.typing.ASGI3Application`` gave 84 errors in 9 files, ``Send`` from
``ASGISendCallable`` 44, ``Scope`` 38 and ``Receive`` from
``ASGIReceiveCallable`` 22: the callable types carry the unions with them, so
none can be adopted alone, and adopting all of them means narrowing or a
``cast`` at every ``message["body"]`` and every wrapped ``send``. They would
not help hosts either: FastAPI's typed ``add_middleware`` accepts these
aliases (they are structurally Starlette's), and Litestar's
``DefineMiddleware`` rejects asgiref-typed and MutableMapping-typed
middleware alike. So the aliases stay, and ``asgiref`` is a development
dependency only: ``tests/test_asgi_messages.py`` holds every message the whole
stack sends or receives against asgiref's TypedDicts, which is where the spec's
shapes serve.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
