"""uvicorn's httptools protocol, without a chunked request's trailer fields.

uvicorn's :class:`~uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`
appends the trailer fields of a chunked request (``0\\r\\nX-Forwarded-For:
...\\r\\n\\r\\n``) to the list it handed the app as ``scope["headers"]``: a
trailer then reads as a request header, and a gateway would forward it as one.
When the whole request arrives in one read, that happens before the app has
run at all, so nothing in the app can tell the two apart. This protocol drops
every field that comes after the head. ``tierchain serve`` uses it whenever
httptools is installed; a host app under uvicorn passes it in code
(``uvicorn.run(app, http=HttpToolsWithoutTrailers)``) or runs ``--http h11``
(uvicorn's h11 protocol ignores trailers).

Needs ``httptools`` (``pip install httptools``, part of ``uvicorn[standard]``).
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HttpToolsWithoutTrailers"]


# uvicorn's protocol class and its parser callbacks are not a documented API: a deliberate
# divergence, see docs/internals.md; tests/test_dependency_internals.py fails if they move.
class HttpToolsWithoutTrailers(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` that keeps the head's fields only, never the trailers."""

    drops_trailers = True
    """Read by the gateway (``tierchain._runtime.server``): this protocol needs no refusal of
    a chunked request read whole before the app ran."""

    _past_head = False

    def on_message_begin(self) -> None:
        self._past_head = False
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._past_head:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._past_head = True
        super().on_headers_complete()
