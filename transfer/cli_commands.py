"""Subcommands other than demo, each in its own module, registered on import.

Each module decorates its handler with `transfer.cli.command(name, help)(add_args)`.
"""

from __future__ import annotations

from weight_transfer.transfer import (  # noqa: F401
    cli_bench,
    cli_doctor,
    cli_emulate,  # noqa: F401
    cli_plan,  # noqa: F401
    cli_vllm,  # noqa: F401
)
