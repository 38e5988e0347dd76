"""The split strategy: cut graphs (``apply``), DDP's buckets matched to them (``ready_order``),
how well (``alignment``)."""

from .apply import apply_split

__all__ = ["apply_split"]
