"""The `weight-transfer` command line: demo, demo-vllm, bench, plan, simulate, emulate, doctor,
token.

Each subcommand lives in its own module of this package and lists itself in that module's
`COMMANDS`; `main` reads those lists (no registration by import side effect).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    from weight_transfer.cli import bench, demo, demo_vllm, doctor, emulate, plan, token

    commands = {
        c.name: c
        for module in (bench, demo, demo_vllm, doctor, emulate, plan, token)
        for c in module.COMMANDS
    }

    parser = argparse.ArgumentParser(
        prog="weight-transfer",
        description="Move RL trainer weights into inference engines with one-sided writes.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, c in sorted(commands.items()):
        c.add_arguments(
            sub.add_parser(
                name,
                help=c.help,
                description=c.help,
                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
            )
        )
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if ns.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    return commands[ns.command].run(ns)


if __name__ == "__main__":
    sys.exit(main())
