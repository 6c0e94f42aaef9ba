"""``python -m tierchain``: the command line (replaced by the CLI module)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["demo"]:
        from .demo import main as demo_main

        return demo_main(args[1:])
    print("usage: tierchain demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
