"""The split strategy, in one place: graphs cut at DDP's bucket boundaries (``apply``), DDP's
rebuilt buckets made to coincide with the segments (``ready_order``) and how well they do
(``alignment``)."""

from .apply import apply_split

__all__ = ["apply_split"]
