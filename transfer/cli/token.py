"""`weight-transfer token`: a fresh control-plane token."""

from __future__ import annotations

import argparse

from weight_transfer.cli.command import Command


def _token_args(p: argparse.ArgumentParser) -> None:
    del p  # no options


def _token(ns: argparse.Namespace) -> int:
    from weight_transfer.config import new_token

    print(new_token())
    return 0


COMMANDS = (
    Command(
        "token",
        "print a fresh control-plane token (256 random bits) for every member's config",
        _token_args,
        _token,
    ),
)
