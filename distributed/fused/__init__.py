"""The fused strategy, in one place: bucket collectives traced into the compiled backward.

``apply`` (one graph: plan, rank check, passes, compile), ``sync`` (the bucket all-reduce graph
pass, NOTE [fused strategy]), ``embedding_rows`` (embedding gradients as gathered rows),
``comm_hooks``, ``powersgd``, ``powersgd_run`` and ``variants`` (comm hooks reproduced in the
graph), ``runtime`` (what the graphs leave to the run time, NOTE [fused strategy runtime]),
``policy`` (where fused applies).
"""

from .apply import FusedState, apply_fused, fused_backend_options

__all__ = ["FusedState", "apply_fused", "fused_backend_options"]
