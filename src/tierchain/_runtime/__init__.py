"""The runtime room: what tierchain does with time and the event loop, behind plain names.

Modules here stand in for standard asyncio calls, each for a measured reason that its
docstring names. So far: :mod:`.clock`, the one clock every layer reads, which tests can
switch to virtual time (:func:`tierchain.testing.virtual_time`).
"""
