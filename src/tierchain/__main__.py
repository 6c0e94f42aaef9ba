"""The ``tierchain`` command line.

::

    tierchain serve [--host H] [--port P] run the configured gateway under uvicorn
    tierchain check-config [--json]      the effective stack, routes and settings, or every problem
    tierchain burst-probe URL --model M  the admission-control probe (needs --yes)
    tierchain demo                       the README's demo

Exit status: 0 success, 1 the probe measured nothing, 2 a usage or
configuration problem (or a probe that was not confirmed with ``--yes``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ._checks import TEXT_DURATION, duration, parse_duration
from .backend import Pool
from .endpoints import PATHS as ENDPOINT_PATHS
from .telemetry import VERSION

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierchain",
        description=(
            "Operate a tierchain gateway: serve it, check its configuration, probe a backend."
        ),
    )
    parser.add_argument("--version", action="version", version=f"tierchain {VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the gateway the TIERCHAIN_* variables describe, under uvicorn",
        description="Serve the whole stack from the TIERCHAIN_* variables and the routes file "
        "under uvicorn (the 'serve' extra). Logs one line per event on stderr "
        "(TIERCHAIN_LOG_FORMAT=text|json). On SIGTERM or SIGINT, stops accepting, lets requests "
        "in flight finish for up to TIERCHAIN_DRAIN_TIMEOUT seconds, then exits 0.",
    )
    serve.add_argument("--host", help="address to listen on (default: TIERCHAIN_HOST, 127.0.0.1)")
    serve.add_argument(
        "--port",
        type=int,
        help="port to listen on, 0 for any free one (default: TIERCHAIN_PORT, 8080)",
    )

    check = sub.add_parser(
        "check-config",
        help="print the effective stack, routes and settings from TIERCHAIN_* variables",
        description="Read the TIERCHAIN_* variables and the routes file; print the effective "
        "stack (outermost first), routes and settings with secrets masked, or every problem "
        "found (exit 2).",
    )
    check.add_argument("--json", action="store_true", help="print JSON instead of text")

    probe = sub.add_parser(
        "burst-probe",
        help="the admission-control probe: concurrency 1, 5, 10, 30, three repeats",
        description="Send the shortest identical prompt with max_tokens 1 at concurrency 1, 5, "
        "10 and 30, three repeats each, to an OpenAI-compatible URL, and say what the latencies "
        "and statuses do and do not show. Every call spends tokens: it refuses to start without "
        "--yes.",
    )
    probe.add_argument("url", help="base URL (http://host:8000), .../v1, or the endpoint itself")
    probe.add_argument("--model", required=True, help="the model name to send")
    probe.add_argument("--yes", action="store_true", help="really make the calls")
    probe.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="name of the variable holding an API key (sent as a bearer token)",
    )
    probe.add_argument(
        "--timeout",
        type=_seconds,
        default=180.0,
        help="seconds each call may take in all, such as 180, 90s or 3m "
        "(default 180: above a 138.5 s cold model load)",
    )

    demo = sub.add_parser("demo", help="run the demo the README shows", add_help=False)
    demo.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _seconds(text: str) -> float:
    """A command-line duration, in the grammar of the ``TIERCHAIN_*`` variables."""
    try:
        return parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {TEXT_DURATION}, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["demo"]:
        from .demo import main as demo_main

        return int(demo_main(args_list[1:]) or 0)
    parser = _parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    if args.command == "serve":
        return serve(host=args.host, port=args.port)
    if args.command == "check-config":
        return check_config(as_json=args.json)
    if args.command == "burst-probe":
        return burst_probe(
            args.url,
            model=args.model,
            yes=args.yes,
            api_key_env=args.api_key_env,
            timeout=args.timeout,
        )
    parser.print_help(sys.stderr)
    return 2


# -- serve --------------------------------------------------------------------------


def serve(*, host: str | None = None, port: int | None = None) -> int:
    """Run ``tierchain serve`` (see :mod:`tierchain.serve`); returns the exit status."""
    try:
        from .serve import run
    except ImportError as exc:
        print(
            f"tierchain serve needs uvicorn ({exc}): pip install 'tierchain[serve]'",
            file=sys.stderr,
        )
        return 2
    return run(host=host, port=port)


# -- check-config -------------------------------------------------------------------


def check_config(
    *,
    as_json: bool = False,
    environ: dict[str, str] | None = None,
    out: TextIO | None = None,
) -> int:
    """Print the effective configuration and its warnings (exit 0), or every problem (exit 2)."""
    from .config import ConfigError, config_warnings

    out = sys.stdout if out is None else out
    env = dict(os.environ) if environ is None else environ
    try:
        settings = _checked_settings(env)
    except (ConfigError, ImportError) as exc:
        problems = exc.problems if isinstance(exc, ConfigError) else (str(exc),)
        _print_problems(problems, as_json=as_json, out=out)
        return 2
    warnings = config_warnings(settings)
    if as_json:
        _print_json(settings, warnings, out)
    else:
        _print_text(settings, warnings, out)
    return 0


def _checked_settings(env: dict[str, str]) -> Any:
    """The settings, checked by every constructor too (a stack built once around a stand-in
    handler, so with the one check of serve's own Forwarder added by hand)."""
    from .config import ConfigError, from_env
    from .stack import build_stack, unrouted

    settings = from_env(env)

    async def dummy(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover
        return None

    build_stack(dummy, settings, identity=False)
    if unrouted(settings):
        raise ConfigError(unrouted(settings))
    return settings


def _print_problems(problems: Sequence[str], *, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(json.dumps({"ok": False, "problems": list(problems)}, indent=2), file=out)
        return
    print(f"tierchain {VERSION}: {len(problems)} configuration problem(s):", file=out)
    for problem in problems:
        print(f"  - {problem}", file=out)


def _print_json(settings: Any, warnings: list[str], out: TextIO) -> None:
    from .identity import identity_fields
    from .stack import limits_view

    fields = identity_fields(settings=settings)
    doc = {
        "ok": True,
        "warnings": warnings,
        "stack": _stack_rows(settings),
        "limits": limits_view(settings),
        "routes": fields["routes"],
        "wire_formats": _wire_formats(settings),
        "pools": _pools(settings),
        "settings": fields["settings"],
    }
    print(json.dumps(doc, indent=2), file=out)


def _print_text(settings: Any, warnings: list[str], out: TextIO) -> None:
    from .identity import identity_fields

    fields = identity_fields(settings=settings)
    noted = f", with {len(warnings)} warning(s) listed at the end" if warnings else ""
    print(f"tierchain {VERSION}: configuration OK{noted}", file=out)
    print("\nstack, outermost first:", file=out)
    for i, row in enumerate(_stack_rows(settings), 1):
        opts = "  ".join(f"{k}={_val(v)}{_src(row, k)}" for k, v in row["options"].items())
        print(f"  {i}. {row['name']:<19} {opts}".rstrip(), file=out)
    print(f"\nroutes ({settings.routes_file or 'none'}):", file=out)
    _print_routes(settings, fields["routes"] or {}, out)
    store_opts = "".join(
        f"  {k}={_val(v)}" for k, v in fields["settings"]["options"].get("RedisStore", {}).items()
    )
    print(f"\nstore: {fields['settings']['store_url']}{store_opts}", file=out)
    if warnings:
        print(f"\n{len(warnings)} warning(s):", file=out)
        for warning in warnings:
            print(f"  - {warning}", file=out)


def _print_routes(settings: Any, shown_routes: dict[str, Any], out: TextIO) -> None:
    """Each route's wire format and tiers (a pool with its replicas), as the identity line
    shows its backends."""
    wires = _wire_formats(settings)
    routes = settings.routes
    for route, chain in shown_routes.items():
        print(f"  {route}:  wire format {wires[route]}", file=out)
        shown = {b["name"]: b for b in chain}
        for n, tier in enumerate(routes.tiers(route) if routes is not None else (), 1):
            if isinstance(tier, Pool):
                names = ", ".join(r.name for r in tier.backends)
                print(
                    f"    {n}. pool {tier.name}: {len(tier.backends)} replicas ({names}), "
                    "one tier: each attempt picks one by its live state",
                    file=out,
                )
                for replica in tier.backends:
                    line = _backend_line(shown[replica.name], replica.wire_format)
                    print(f"       - {line}", file=out)
            else:
                print(f"    {n}. {_backend_line(shown[tier.name], tier.wire_format)}", file=out)


_BACKEND_SHOWN = (
    "regime",
    "model",
    "status_url",
    "stream_end",
    "stall_after",
    "first_token",
    "max_in_flight",
    "price_input",
    "price_output",
)


def _backend_line(b: dict[str, Any], wire_format: str | None) -> str:
    extra = "".join(f"  {k}={_val(b[k])}" for k in _BACKEND_SHOWN if k in b)
    if wire_format is not None:
        extra += f"  wire_format={wire_format}"
    if b.get("forward_caller_auth"):
        extra += "  forward_caller_auth=true"
    hdrs = f"  headers={','.join(b['headers'])}" if "headers" in b else ""
    return f"{b['name']:<12} {b['url']}{extra}{hdrs}"


def _wire_formats(settings: Any) -> dict[str, str]:
    """Each route's wire format: the one set for it, or recognised from each request's path."""
    routes = settings.routes
    if routes is None:
        return {}
    return {
        route: routes.wire_format(route)
        or "from each request's path (openai, responses, anthropic, ollama)"
        for route in routes
    }


def _pools(settings: Any) -> dict[str, dict[str, list[str]]]:
    """Per route, each pool and the replicas that form it (routes without a pool left out)."""
    routes = settings.routes
    if routes is None:
        return {}
    found: dict[str, dict[str, list[str]]] = {}
    for route in routes:
        for tier in routes.tiers(route):
            if isinstance(tier, Pool):
                found.setdefault(route, {})[tier.name] = [r.name for r in tier.backends]
    return found


def _stack_rows(settings: Any) -> list[dict[str, Any]]:
    effective = settings.effective()["options"]
    rows: list[dict[str, Any]] = []
    if settings.identity:
        rows.append({"name": "StartupIdentity", "options": {}, "sources": {}})
    if settings.admin_enabled:
        rows.append(
            {
                "name": "Admin",
                "options": {"path": settings.admin_path, **effective.get("Admin", {})},
                "sources": dict(settings.layers["Admin"].sources),
            }
        )
    rows.append(
        {
            "name": "Endpoints",
            "options": {"paths": list(ENDPOINT_PATHS), **effective.get("Endpoints", {})},
            "sources": dict(settings.layers["Endpoints"].sources),
        }
    )
    if settings.layers["CallerKeys"].options:
        rows.append(
            {
                "name": "CallerKeys",
                "options": effective.get("CallerKeys", {}),
                "sources": dict(settings.layers["CallerKeys"].sources),
            }
        )
        rows.append({"name": "KeyLimits", "options": _limits_options(settings), "sources": {}})
    for name in settings.stack:
        rows.append(
            {
                "name": name,
                "options": effective.get(name, {}),
                "sources": dict(settings.layers[name].sources),
            }
        )
        if name == "SaturationWatchdog" and "Allowance" in effective:
            rows.append(
                {
                    "name": "  Allowance",
                    "options": effective["Allowance"],
                    "sources": dict(settings.layers["Allowance"].sources),
                }
            )
    rows.append(
        {
            "name": "handler: Forwarder",
            "options": effective.get("Forwarder", {}),
            "sources": dict(settings.layers["Forwarder"].sources),
        }
    )
    return rows


def _limits_options(settings: Any) -> dict[str, Any]:
    """KeyLimits' row: its default, then per key *name* its limits (or "counted")."""
    from .stack import limits_view

    view = limits_view(settings) or {}
    options: dict[str, Any] = {"default_max_tokens": view.get("default_output")}
    for key in view.get("keys", ()):
        said = []
        for name, value in key.items():
            if name == "budget":
                said.append(f"budget {value} tokens/{key['budget_period']}")
            elif name == "default_output":
                said.append(f"default_max_tokens {value}")
            elif name not in ("name", "budget_period"):
                said.append(f"{name} {value}")
        options[f"keys.{key['name']}"] = ", ".join(said) if said else "counted, no limits"
    for budget in view.get("backend_budgets", ()):
        options[f"backend.{budget['backend']}"] = (
            f"{budget['budget']} tokens/{budget['budget_period']}"
        )
    return options


def _val(value: Any) -> str:
    if value is None:
        return "none"
    return json.dumps(value) if not isinstance(value, str) else value


def _src(row: dict[str, Any], key: str) -> str:
    env = row["sources"].get(key)
    return f" ({env})" if env else ""


# -- burst-probe ----------------------------------------------------------------------


def burst_probe(
    url: str,
    *,
    model: str,
    yes: bool,
    api_key_env: str | None = None,
    timeout: float = 180.0,
    environ: dict[str, str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Refuse without ``yes`` (naming the call count); otherwise run and print the verdict."""
    from . import burst
    from .masking import mask_text, mask_url

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    env = os.environ if environ is None else environ
    calls = burst.planned_calls()
    levels = ", ".join(str(n) for n in burst.LEVELS)
    try:
        endpoint = burst.chat_url(url)
    except ValueError as exc:
        print(f"tierchain burst-probe: {mask_text(str(exc), url)}", file=err)
        return 2
    shown = mask_url(endpoint)  # the URL may carry a key
    try:
        duration("--timeout", timeout)
    except ValueError as exc:
        print(f"tierchain burst-probe: {exc}", file=err)
        return 2
    api_key = None
    if api_key_env:
        api_key = env.get(api_key_env)
        if not api_key:
            print(
                f"tierchain burst-probe: --api-key-env {api_key_env}: that variable is not set "
                "or is empty",
                file=err,
            )
            return 2
    if not yes:
        print(
            f"tierchain burst-probe would make {calls} calls to {shown} (model {model!r}): "
            f"concurrency {levels}, {burst.REPEATS} repeats each, max_tokens 1, each call "
            f"bounded at {timeout:g} s. Every call spends tokens and loads the backend; run it "
            "on an idle backend, outside an incident. Nothing was sent. Add --yes to run it.",
            file=err,
        )
        return 2

    print(f"burst-probe: {calls} calls to {shown} (model {model!r})", file=err)

    def progress(line: str) -> None:
        print(line, file=err, flush=True)

    try:
        result = asyncio.run(
            burst.run_probe(url, model, api_key=api_key, call_timeout=timeout, progress=progress)
        )
    except KeyboardInterrupt:  # pragma: no cover - interactive
        print("burst-probe: interrupted", file=err)
        return 130
    outcome = burst.verdict(result)
    print(outcome.text(), file=out)
    return 1 if outcome.kind == "no_evidence" else 0


if __name__ == "__main__":
    sys.exit(main())
