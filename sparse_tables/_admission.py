"""The admission sketch as checkpointed state (a mixin of ``SparseTable``).

Feature admission counts the pushes of keys that have no row yet in a count-min sketch
(``_kernels.admit``; ``TableConfig.min_count``, ``admit_probability``). Those counts are part of the
training state as much as the rows are: a restore that drops them (as a base loaded into fresh shards
did) makes every key short of ``min_count`` start again from zero, admitted later than in a run without
the failure, and a roll-back that kept the live ones would count the replayed pushes twice (admitted
earlier). So a checkpoint takes a copy
of each shard's sketch in the same locked step as its rows (``rows(clear=True, sketch=...)``,
``dirty_dump(clear=True, sketch=...)``), and a restore puts the checkpoint's counts back
(``restore_sketch``), as Monolith saves its hash filter with the model.
"""
from __future__ import annotations

import numpy as np


class AdmissionSketch:
    """Copy-out and restore of ``self._sketch`` (uint32[sketch_depth, sketch_width], empty without
    admission) under the table's lock ``self._lock``."""

    @property
    def sketch_shape(self) -> tuple[int, int]:
        """(sketch_depth, sketch_width) of this table's admission sketch; (0, 0) without admission."""
        return tuple(self._sketch.shape)

    def _copy_sketch(self, out: list | None) -> None:
        """Append a copy of the sketch (uint32[depth, width]) to ``out``, when given and the table
        admits by count. Lock held (the caller's locked step fixes the instant)."""
        if out is not None and self._sketch.size:
            out.append(self._sketch.copy())

    def restore_sketch(self, counts: np.ndarray) -> bool:
        """Replace the admission sketch's counts by ``counts`` (uint32[sketch_depth, sketch_width], from a
        checkpoint). Returns False, and changes nothing, when the table has no admission sketch or
        ``counts`` has another shape (the table's ``sketch_depth`` / ``sketch_width`` changed since the
        save; ``engine.checkpoint.sketch_parts`` checks it first and says so).

        Raises
        ------
        ValueError
            ``counts`` is not uint32.
        """
        if counts.dtype != np.uint32:
            raise ValueError(f"{self.name}: admission sketch counts must be uint32, got {counts.dtype}")
        with self._lock.exclusive():
            if not self._sketch.size or counts.shape != self._sketch.shape:
                return False
            self._sketch[:] = counts
            return True
