"""bucketwise: torch.compile for DistributedDataParallel, split at gradient buckets.

Public API (kept small on purpose):

- :func:`bucketwise.compile` -- compile a DDP module, a plain module or a function.
- :func:`bucketwise.report` -- per-graph / per-bucket compile statistics of a compiled object.
- :func:`bucketwise.freeze` -- no new compile from now on (a recompile raises or runs eagerly).
- the ``bucketwise`` command (``launch``, ``doctor``, ``stats``, ``demo``, ``--version``).
"""

from .compiler.api import compile
from .compiler.freeze import freeze
from .compiler.report import Report, report

__all__ = ["compile", "report", "freeze", "Report"]
__version__ = "0.1.0"
