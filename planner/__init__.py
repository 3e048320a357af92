"""Pure planning: manifests in, a frozen JSON-serialisable schedule out (no I/O, no clocks)."""
