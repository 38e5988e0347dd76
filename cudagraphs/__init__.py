"""bucketwise's own CUDA-graph wrapper for compiled graphs (``cudagraphs=True``).

Imports ``distributed`` (teardown) and ``_compat`` below it, never ``compiler``, ``stats`` or ``launch``.
"""
