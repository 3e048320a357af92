"""Delta updates, the runtime's part: the patch region and its apply (`patch`), the trainer's
per-update session (`session`), and the debug verifier (`verify`).

The kernels that count, encode and apply live in `weight_transfer.kernels.delta`; the sizes
the planner and simulator predict in `weight_transfer.planner.delta`. See docs/delta.md.
"""
