"""`DeviceLedger`: the device KV bytes a cache holds now, and the most it has held (its high-water mark).

Counted, not estimated: every page pool a store allocates or drops and the dense layers' K/V go through `resized`;
tokens added to a filled cache report the one-layer read-back they allocate (`transient`). Metadata (MinMax entries,
block tables) is reported apart by `FlexiCache.memory_report`.
"""

from __future__ import annotations


class DeviceLedger:
    """Bytes of device KV held now (`current`) and at most so far (`peak`, transients included)."""

    def __init__(self):
        self.current = 0
        self.peak = 0

    def resized(self, old_bytes: int, new_bytes: int) -> None:
        """An allocation went from `old_bytes` to `new_bytes` (0 for a new or a dropped one)."""
        self.current += new_bytes - old_bytes
        self.peak = max(self.peak, self.current)

    def restart_peak(self) -> None:
        """Count the peak from now (a cache emptied for another call: `FlexiCache.reset`)."""
        self.peak = self.current

    def transient(self, nbytes: int) -> None:
        """`nbytes` are held on top of `current` for a while (a layer's read-back), then freed."""
        self.peak = max(self.peak, self.current + nbytes)
