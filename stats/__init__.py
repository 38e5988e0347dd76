"""What happened, for users: reports, compile times, the first step, job-wide stats, profiling.

Imports ``distributed`` and ``_compat`` below it, never ``compiler`` or ``launch`` above.
"""
