"""Replaying a run's trainer from its own record: the same batches, in the same order, on the
same weights, with every restart as it happened (``relax replay``); and the record itself,
written by the trainer as it goes (``[trainer] record``)."""

from relax.replay._generations import (
    GENERATIONS_DIR,
    GenerationLog,
    RegenerateReport,
    chunk_schedules,
    read_calls,
)
from relax.replay._record import (
    RECORD_DIR,
    Record,
    RecordError,
    RecordWriter,
    comparable_metrics,
    drop_unpublished,
    weights_digest,
)
from relax.replay._replay import Divergence, ReplayReport, replay

__all__ = [
    "GENERATIONS_DIR",
    "RECORD_DIR",
    "Divergence",
    "GenerationLog",
    "Record",
    "RecordError",
    "RecordWriter",
    "RegenerateReport",
    "ReplayReport",
    "chunk_schedules",
    "comparable_metrics",
    "drop_unpublished",
    "read_calls",
    "replay",
    "weights_digest",
]
