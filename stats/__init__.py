"""What happened, for users: reports, compile times, the first step, job-wide stats, profiling.

``report`` (``bucketwise.report``: per graph, segment and bucket), ``compile_times`` and
``first_step`` (where compile seconds and the first step go), ``job_stats`` (every rank's report
reaching rank 0), ``profiling``, ``runtime_view`` and ``trace_analysis``
(``bucketwise.profile``: per-bucket communication from a profiler trace), ``table`` (the one
text-table formatter). Imports ``distributed`` and ``_compat`` below it, never ``compiler`` or
``launch`` above.
"""
