"""The runtime room: what tierchain does with time and the event loop, behind plain names.

Modules here stand in for standard asyncio calls, each for a measured reason that its
docstring names: :mod:`.clock`, the one clock every layer reads, which tests can switch to
virtual time (:func:`tierchain.testing.virtual_time`), and the wall clock for what another
process reads; :mod:`.deadlines`, the scheduler, the
one loop timer per event loop for everything the package times, with its one tolerance
``EARLY``; :mod:`.interrupt`, the one owner of cancelling a task with a reason (layers hold
one, never subclass it); :mod:`.eager`,
the eager start of a coroutine; :mod:`.lag`, how late the loop runs; :mod:`.loops`, one object
per event loop; :mod:`.server`, whether uvicorn's httptools protocol put a request's trailers
among its headers before the app ran.
"""
