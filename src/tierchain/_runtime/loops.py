"""One object per event loop: what the scheduler and the lag monitor hang on.

The objects refer to their loop, so the registry is a plain dict, not a
WeakKeyDictionary (whose values would keep their keys alive); the entries of
closed loops (finished tests, past ``asyncio.run()`` calls) are dropped when a
new loop comes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["PerLoop"]

T = TypeVar("T")

_KEEP = 8  # loops held before closed ones are looked for


class PerLoop(Generic[T]):
    """The running loop's ``T``, made by ``factory(loop)`` on first use in that loop."""

    __slots__ = ("_by_loop", "_factory", "last", "last_loop")

    def __init__(self, factory: Callable[[asyncio.AbstractEventLoop], T]) -> None:
        self._factory = factory
        self._by_loop: dict[asyncio.AbstractEventLoop, T] = {}
        self.last_loop: asyncio.AbstractEventLoop | None = None
        # The last loop asked for and its object: the usual path is one test of identity.
        # ``last`` is read only while ``last_loop`` is a loop, so it is never read as None.
        self.last: T = None  # type: ignore[assignment]

    def get(self) -> T:
        """The running loop's object (one test of identity on the usual path)."""
        loop = asyncio.get_running_loop()
        if loop is self.last_loop:
            return self.last
        made = self._by_loop.get(loop)
        if made is None:
            if len(self._by_loop) > _KEEP:
                for old in [lp for lp in self._by_loop if lp.is_closed()]:
                    del self._by_loop[old]
            made = self._by_loop[loop] = self._factory(loop)
        self.last_loop, self.last = loop, made
        return made

    def __len__(self) -> int:
        return len(self._by_loop)
