"""The burst probe: does something queue or shed a burst of identical calls?

The method: concurrency 1, 5, 10 and 30, three repeats each, the shortest
identical prompt with ``max_tokens: 1``, against an OpenAI-compatible
``/v1/chat/completions``. Every call in a round is released at the same
moment; the latency of each is the time to its whole (one-token) answer.

The verdict is only as strong as the evidence:

- latency that grows with concurrency is evidence of serialization or
  admission queueing somewhere between this client and the GPU, but not of
  where;
- flat latency cannot tell "no admission control" from "a backend that
  absorbed the burst", and says so instead of picking;
- 429 answers are a rate limiter answering, which is not the backend shedding
  load (a limiter at 1/s with a burst of 1 answers 429 to 29 of 30 calls and
  would otherwise read as "the backend sheds");
- calls that got no HTTP answer at all are reported as failures, not evidence.

The client side cannot see admission delay as such: the server's own queue-wait
span is where that answer lives.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import urlsplit

import httpx

from ._checks import duration
from ._runtime import clock
from .masking import mask_url

__all__ = [
    "LEVELS",
    "REPEATS",
    "Call",
    "ProbeResult",
    "Verdict",
    "chat_url",
    "planned_calls",
    "run_probe",
    "verdict",
]

LEVELS = (1, 5, 10, 30)
REPEATS = 3
PROMPT = "hi"
GROWTH = 2.0
"""p50 at the top level over p50 at the bottom level at or above which latency "grows"."""
FLAT = 1.5
"""Below this ratio latency is "flat"; between FLAT and GROWTH it is too little to call."""
NOISE = 0.02
"""Seconds of p50 difference below which latency counts as flat whatever the ratio."""


def planned_calls(levels: Sequence[int] = LEVELS, repeats: int = REPEATS) -> int:
    """How many calls a run makes: ``repeats * sum(levels)`` (138 for the standard run)."""
    return repeats * sum(levels)


def chat_url(url: str) -> str:
    """The chat completions endpoint for a base URL (``http://h:8000``, ``.../v1`` or itself)."""
    parts = urlsplit(url)
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ValueError(f"{mask_url(url)!r} is not an http or https URL")
    path = parts.path.rstrip("/")
    if path.endswith("/chat/completions"):
        return url
    if path.endswith("/v1"):
        return url.rstrip("/") + "/chat/completions"
    return url.rstrip("/") + "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Call:
    """One call's outcome: its HTTP status (None when there was no answer) and latency."""

    level: int
    repeat: int
    status: int | None
    seconds: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


@dataclass(slots=True)
class ProbeResult:
    """Every call of a run, grouped by concurrency level."""

    url: str
    model: str
    levels: tuple[int, ...]
    repeats: int
    calls: list[Call] = field(default_factory=list)

    def at(self, level: int) -> list[Call]:
        return [c for c in self.calls if c.level == level]

    def p50(self, level: int) -> float | None:
        """Median latency of the successful calls at ``level`` (None when none succeeded)."""
        ok = [c.seconds for c in self.at(level) if c.ok]
        return statistics.median(ok) if ok else None


@dataclass(frozen=True, slots=True)
class Verdict:
    """``kind`` (``growth``, ``flat``, ``inconclusive``, ``no_evidence``) and the sentences."""

    kind: str
    findings: tuple[str, ...]
    table: tuple[str, ...]

    def text(self) -> str:
        return "\n".join([*self.table, "", *self.findings])


async def _one(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, object],
    headers: dict[str, str],
    go: asyncio.Event,
    level: int,
    repeat: int,
    limit: float,
) -> Call:
    await go.wait()
    start = clock.now()
    try:
        async with asyncio.timeout(limit):
            response = await client.post(url, json=body, headers=headers)
        return Call(level, repeat, response.status_code, clock.now() - start)
    except TimeoutError:
        return Call(level, repeat, None, clock.now() - start, f"timeout after {limit:g}s")
    except httpx.HTTPError as exc:
        return Call(level, repeat, None, clock.now() - start, type(exc).__name__)


async def run_probe(
    url: str,
    model: str,
    *,
    api_key: str | None = None,
    levels: Sequence[int] = LEVELS,
    repeats: int = REPEATS,
    call_timeout: float | timedelta = 180.0,
    progress: Callable[[str], None] | None = None,
) -> ProbeResult:
    """Run the probe; each call is bounded by ``call_timeout`` seconds in all."""
    if not levels or any(n < 1 for n in levels) or repeats < 1:
        raise ValueError("levels must be concurrencies >= 1 and repeats >= 1")
    timeout = duration("call_timeout", call_timeout)
    endpoint = chat_url(url)
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 1,
        "stream": False,
    }
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    result = ProbeResult(url=endpoint, model=model, levels=tuple(levels), repeats=repeats)
    total = planned_calls(levels, repeats)
    limits = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), limits=limits
    ) as client:
        for level in levels:
            for repeat in range(1, repeats + 1):
                go = asyncio.Event()
                async with asyncio.TaskGroup() as group:
                    tasks = [
                        group.create_task(
                            _one(client, endpoint, body, headers, go, level, repeat, timeout)
                        )
                        for _ in range(level)
                    ]
                    go.set()
                calls = [t.result() for t in tasks]
                result.calls.extend(calls)
                if progress is not None:
                    progress(
                        _progress_line(len(result.calls), total, level, repeat, repeats, calls)
                    )
    return result


def _progress_line(
    done: int, total: int, level: int, repeat: int, repeats: int, calls: list[Call]
) -> str:
    ok = [c.seconds for c in calls if c.ok]
    counts = Counter(_label(c) for c in calls)
    summary = ", ".join(f"{n} {label}" for label, n in sorted(counts.items()))
    p50 = f", p50 {statistics.median(ok):.3f} s" if ok else ""
    width = len(str(total))
    return (
        f"[{done:>{width}}/{total}] concurrency {level:>2}, repeat {repeat}/{repeats}: "
        f"{summary}{p50}"
    )


def _label(call: Call) -> str:
    if call.ok:
        return "ok"
    if call.status is not None:
        return f"HTTP {call.status}"
    return call.error or "error"


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s"


def verdict(result: ProbeResult) -> Verdict:
    """What the run shows, and no more."""
    table = _table(result)
    findings = _failures(result)
    measured = [lv for lv in result.levels if result.p50(lv) is not None]
    if len(measured) < 2:
        findings.append(
            "Too few calls succeeded at two or more concurrency levels to compare latency: "
            "this run says nothing about admission control."
        )
        return Verdict("no_evidence", tuple(findings), tuple(table))
    kind = _latency(result, measured[0], measured[-1], findings)
    return Verdict(kind, tuple(findings), tuple(table))


def _table(result: ProbeResult) -> list[str]:
    """The run as a table: one row a concurrency level."""
    table = [f"{'concurrency':>11}  {'calls':>5}  {'ok':>4}  {'p50':>9}  {'slowest':>9}  other"]
    for level in result.levels:
        calls = result.at(level)
        ok = [c.seconds for c in calls if c.ok]
        other = Counter(_label(c) for c in calls if not c.ok)
        table.append(
            f"{level:>11}  {len(calls):>5}  {len(ok):>4}  {_fmt(result.p50(level)):>9}  "
            f"{_fmt(max(ok) if ok else None):>9}  "
            + (", ".join(f"{n}x {label}" for label, n in sorted(other.items())) or "-")
        )
    return table


def _failures(result: ProbeResult) -> list[str]:
    """What the calls that did not succeed say (and do not say)."""
    findings: list[str] = []
    total = len(result.calls)
    failed = [c for c in result.calls if c.status is None]
    limited = [c for c in result.calls if c.status == 429]
    refused = [c for c in result.calls if c.status is not None and not c.ok and c.status != 429]

    if failed:
        kinds = Counter(c.error or "error" for c in failed)
        findings.append(
            f"{len(failed)} of {total} calls got no HTTP answer ("
            + ", ".join(f"{n}x {k}" for k, n in sorted(kinds.items()))
            + "). Failed calls are not evidence about admission control; "
            "look at why they failed before reading anything else into this run."
        )
    if limited:
        worst = max(result.levels, key=lambda lv: sum(1 for c in limited if c.level == lv))
        findings.append(
            f"{len(limited)} of {total} calls were answered 429 (most at concurrency {worst}). "
            "A rate limiter answered: that is a rate limiter (in the gateway or in front of it), "
            "not the backend shedding load. Raise or bypass the limiter and run again to "
            "measure the backend."
        )
    if refused:
        statuses = Counter(c.status for c in refused)
        findings.append(
            f"{len(refused)} of {total} calls were answered with an error status ("
            + ", ".join(f"{n}x HTTP {s}" for s, n in sorted(statuses.items()))
            + "). Something refused or failed under the burst; from the client side it cannot "
            "be told whether the backend, a proxy or a limiter answered."
        )
    return findings


def _latency(result: ProbeResult, low: int, high: int, findings: list[str]) -> str:
    """The verdict's kind from the p50 at the lowest and highest level measured; its
    finding appended to ``findings``."""
    base, top = result.p50(low), result.p50(high)
    assert base is not None
    assert top is not None
    ratio = top / base if base > 0 else float("inf")
    shape = f"p50 {_fmt(base)} at concurrency {low}, {_fmt(top)} at {high}, x{ratio:.1f}"
    if ratio >= GROWTH and top - base >= NOISE:
        kind = "growth"
        findings.append(
            f"Latency grows with concurrency ({shape}): evidence of serialization or admission "
            "queueing somewhere between this client and the backend. It does not say where: "
            "a gateway queue, the server's scheduler and a single GPU slot look the same from "
            "here; the server-side queue-wait span would."
        )
    elif ratio < FLAT or top - base < NOISE:
        kind = "flat"
        findings.append(
            f"Latency is flat ({shape}). This cannot distinguish no admission control from a "
            "backend that absorbed the burst; a larger burst or the server-side queue-wait "
            "span would tell them apart."
        )
    else:
        kind = "inconclusive"
        findings.append(
            f"Latency grows a little ({shape}): too little to call either way. Treat it as "
            "inconclusive and look at the server-side queue-wait span."
        )
    ok_top = sum(1 for c in result.at(high) if c.ok)
    if ok_top * 2 < len(result.at(high)):
        findings.append(
            f"Only {ok_top} of {len(result.at(high))} calls succeeded at concurrency {high}, "
            "so the latency comparison rests on the calls that got through: weak evidence."
        )
        if kind == "growth":
            kind = "inconclusive"
    return kind
