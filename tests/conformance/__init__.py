"""The transport conformance suite: one set of tests every Transport must pass."""
