"""Subcommands other than demo: doctor, plan, simulate, bench (registered on import)."""

from __future__ import annotations
