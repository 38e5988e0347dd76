"""bucketwise: torch.compile for DistributedDataParallel, split at gradient buckets.

Public API (kept small on purpose):

- :func:`bucketwise.compile` -- compile a DDP module, a plain module or a function.
- :func:`bucketwise.report` -- per-graph / per-bucket compile statistics of a compiled object.
- the ``bucketwise`` command (``launch``, ``stats``, ``demo``).
"""

from .compiler.api import compile
from .compiler.report import Report, report

__all__ = ["compile", "report", "Report"]
__version__ = "0.1.0"
