"""Failover: own the chain, call the inner app once per attempt (see docs/failover.md).

The package's modules, each one job:

- :mod:`~tierchain.failover.middleware`: :class:`Failover`, its options and the
  request's steps (the route, the chain, each attempt, what comes after it);
- :mod:`~tierchain.failover.route`: the route from the body, the reorderings;
- :mod:`~tierchain.failover.plan`: what to try after an attempt that did not answer
  (a typed :class:`~tierchain.failover.plan.Fault`), retries, the waiting room's wait;
- :mod:`~tierchain.failover.pools`: a chain with a pool or shared hardware;
- :mod:`~tierchain.failover.attempt`: one attempt's call of the inner app
  (``call_inner``, a hedge's too) and its ``send`` (``Responder``);
- :mod:`~tierchain.failover.call`: the attempt's span made current, its own abort told
  from other cancellations;
- :mod:`~tierchain.failover.hedging`: a quiet attempt joined by the next tier (a race),
  the hedge run as every attempt;
- :mod:`~tierchain.failover.continuation`: whether a broken stream is finished on the
  next tier (``continue_stream``) and its seam, asked of its wire format;
- :mod:`~tierchain.failover.continuing`: the attempt that finishes it (``Continuing``);
- :mod:`~tierchain.failover.answers`: the refusals and the final 503, 429 or 502.

Only the names in ``__all__`` are this package's interface (``BACKEND_HEADER``, ``_WAIT_POLL``
and ``_may_retry`` stay importable from here, where they were); the modules' own names may
change.
"""

from ..errors import ResolveError
from ..request import DEFAULT_SEND_TIMEOUT
from .attempt import BACKEND_HEADER  # noqa: F401
from .middleware import _WAIT_POLL, DEFAULT_RETRY_STATUSES, Failover  # noqa: F401
from .plan import may_retry as _may_retry  # noqa: F401
from .route import Resolver

__all__ = ["DEFAULT_RETRY_STATUSES", "DEFAULT_SEND_TIMEOUT", "Failover", "ResolveError", "Resolver"]
