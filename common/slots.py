"""Slot conventions shared by the manager (which allocates slots) and the workers (which own arenas)."""

ZERO_SLOT = 0  # always zero: an initial state, and the input of padding rows
SCRATCH_SLOT = 1  # written by padding rows, never read
FIRST_FREE_SLOT = 2
