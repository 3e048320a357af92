"""One CLI subcommand: its name, help line, argument builder and handler."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True, slots=True)
class Command:
    """A `weight-transfer` subcommand; each command module lists its own in `COMMANDS`."""

    name: str
    """The word on the command line."""
    help: str
    """One line for `--help`."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the subcommand's options to its parser."""
    run: Callable[[argparse.Namespace], int]
    """Runs it; returns the exit code (0 ok, 1 failed, 2 bad input)."""
