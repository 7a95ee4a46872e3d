"""Observability of a run: metrics sinks, the Prometheus endpoint, per-actor log files.

- :mod:`relax.observe` sinks — where the trainer's per-step metric records go (``[logging]``
  ``jsonl``, ``tensorboard``, ``wandb``): :class:`MetricsSink`, :func:`build_sinks`,
  :class:`MetricsFanout`;
- the evaluator's records (``[eval]``): ``RUN_DIR/eval.jsonl`` (:data:`EVAL_FILE`,
  :func:`last_eval`) and ``tensorboard/eval/``;
- the Prometheus endpoint — ``http://127.0.0.1:PORT/metrics`` in the cluster's main process,
  collected on scrape from the control-plane status: :func:`serve_metrics`, :func:`render`;
- per-actor JSON log files (``RUN_DIR/logs/<actor>.jsonl``) live in :mod:`relax.log`
  (:func:`relax.log.log_files`), re-exported here.
"""

from relax.log import CLUSTER_LOG, ENV_LOG_DIR, LOGS_DIR, log_file, log_files
from relax.observe._prometheus import (
    ACTOR_STATES,
    MetricsEndpoint,
    StatusCollector,
    StatusSource,
    render,
    serve_metrics,
    status_metrics,
)
from relax.observe._sinks import (
    EVAL_FILE,
    EVAL_TENSORBOARD_DIR,
    METRICS_FILE,
    TENSORBOARD_DIR,
    WANDB_DIR,
    WANDB_ID_FILE,
    JsonlSink,
    MetricsFanout,
    MetricsSink,
    MissingPackage,
    TensorBoardSink,
    WandbSink,
    build_sinks,
    check_sinks,
    import_wandb,
    last_eval,
    numeric_metrics,
)

__all__ = [
    "ACTOR_STATES",
    "CLUSTER_LOG",
    "ENV_LOG_DIR",
    "EVAL_FILE",
    "EVAL_TENSORBOARD_DIR",
    "LOGS_DIR",
    "METRICS_FILE",
    "TENSORBOARD_DIR",
    "WANDB_DIR",
    "WANDB_ID_FILE",
    "JsonlSink",
    "MetricsEndpoint",
    "MetricsFanout",
    "MetricsSink",
    "MissingPackage",
    "StatusCollector",
    "StatusSource",
    "TensorBoardSink",
    "WandbSink",
    "build_sinks",
    "check_sinks",
    "import_wandb",
    "last_eval",
    "log_file",
    "log_files",
    "numeric_metrics",
    "render",
    "serve_metrics",
    "status_metrics",
]
