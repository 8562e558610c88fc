"""Run artifacts for scalars: metrics.jsonl + TensorBoard, PNG plots, summary.json, live progress.

Importing this package is cheap: tensorboard, matplotlib and tqdm are imported only when a writer is
opened, a plot is drawn or a bar is shown.
"""

from asyncrl.metrics.plots import PLOTS, make_plots
from asyncrl.metrics.progress import Progress, tail_metrics
from asyncrl.metrics.summary import REQUIRED_KEYS, format_summary, validate_summary, write_summary
from asyncrl.metrics.writer import MetricsScan, MetricsWriter, metrics_path, read_metrics, scan_metrics

__all__ = [
    "PLOTS",
    "REQUIRED_KEYS",
    "MetricsScan",
    "MetricsWriter",
    "Progress",
    "format_summary",
    "make_plots",
    "metrics_path",
    "read_metrics",
    "scan_metrics",
    "tail_metrics",
    "validate_summary",
    "write_summary",
]
