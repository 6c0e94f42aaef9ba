"""tierchain: pure-ASGI middlewares that keep an LLM gateway's chain of tiers moving.

Stacking order, outermost first::

    Heartbeats -> Budget -> PreferBackend -> Failover -> Breaker -> SaturationWatchdog -> handler

The host's forwarding handler asks :func:`current_attempt` where to send each
attempt, or is simply :class:`Forwarder`.
"""

from . import config as _config
from .admin import Admin
from .allowance import Allowance
from .backend import Backend, Pool, Routes
from .breaker import Breaker
from .budget import Budget
from .endpoints import Endpoints
from .errors import (
    AttemptError,
    BackendBusy,
    BackendSaturated,
    BackendSkipped,
    BackendUnavailable,
    BodyTooLarge,
    BudgetExhausted,
    CallerStalled,
    ConfigError,
    ResolveError,
    RetryableStatus,
    StoreUnavailable,
    TierchainError,
)
from .failover import Failover
from .forwarder import Forwarder
from .heartbeats import Heartbeats
from .identity import StartupIdentity
from .learned import Learned
from .picker import PickWeights
from .prefer import PreferBackend
from .redis_store import RedisStore
from .request import Attempt, TierRequest, current_attempt
from .shed import Shed
from .stack import build_stack as _build_stack
from .store import MemoryStore
from .telemetry import VERSION as __version__
from .watchdog import SaturationWatchdog

# tierchain.config.build_stack, the old path: set here so that config never imports the
# stack that imports it (docs/internals.md, the floors).
_config.build_stack = _build_stack

__all__ = [
    "Admin",
    "Allowance",
    "Attempt",
    "AttemptError",
    "Backend",
    "BackendBusy",
    "BackendSaturated",
    "BackendSkipped",
    "BackendUnavailable",
    "BodyTooLarge",
    "Breaker",
    "Budget",
    "BudgetExhausted",
    "CallerStalled",
    "ConfigError",
    "Endpoints",
    "Failover",
    "Forwarder",
    "Heartbeats",
    "Learned",
    "MemoryStore",
    "PickWeights",
    "Pool",
    "PreferBackend",
    "RedisStore",
    "ResolveError",
    "RetryableStatus",
    "Routes",
    "SaturationWatchdog",
    "Shed",
    "StartupIdentity",
    "StoreUnavailable",
    "TierRequest",
    "TierchainError",
    "__version__",
    "current_attempt",
]
