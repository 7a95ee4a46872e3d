"""The TransferQueue: a versioned sample bus with leases, exactly-once acks, bounded-staleness
admission and a versioned weights channel.

- ``BusService``: the bus as a supervised actor (serves ``inproc://``, ``ipc://``, ``tcp://``),
  persisted to a checksummed segment log so a SIGKILLed bus comes back with everything.
- ``BusClient``: what roles and user code use from any process: ``admit``, ``put``,
  ``add_columns``, ``take`` (a lease; ack on success), ``publish_weights``, ``poll_weights``.
- ``WeightPublisher`` / ``WeightSubscriber``: the weight plane (``[weights] transport =
  "group"``): versions over a tensor group, checksummed, switched on the bus's commit.
- ``BusTable``: the pure state machine underneath (rows, leases, acks, admission).
- ``SegmentLog``: the crash-safe append-only log.
- ``SCHEMA``: the declared types of the columns roles exchange (``Column``); rows that break
  them are refused at the put (``BadRow``, ``BadColumn``); ``column_problem`` says what is
  wrong with a row's columns.
"""

from relax.bus._client import Batch, BusClient
from relax.bus._columns import SCHEMA, Column, column_problem
from relax.bus._log import LogCorrupt, SegmentLog
from relax.bus._plane import PlaneOptions, WeightPublisher, WeightSubscriber, plane_options
from relax.bus._service import BusService
from relax.bus._table import BusTable, ColumnConflict, UnknownTask
from relax.bus._weights import VersionGone, WeightStore
from relax.errors import BadColumn, BadRow

__all__ = [
    "SCHEMA",
    "BadColumn",
    "BadRow",
    "Batch",
    "BusClient",
    "BusService",
    "BusTable",
    "Column",
    "ColumnConflict",
    "LogCorrupt",
    "PlaneOptions",
    "SegmentLog",
    "UnknownTask",
    "VersionGone",
    "WeightPublisher",
    "WeightStore",
    "WeightSubscriber",
    "column_problem",
    "plane_options",
]
