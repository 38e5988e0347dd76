"""bucketwise's own CUDA-graph wrapper for compiled graphs (``cudagraphs=True``).

``policy``: whether a compile gets CUDA graphs at all (resolved once per compiled object) and
which graphs may be captured; ``runner``: the runners that capture and replay Inductor-compiled
graphs, and the inner compile that wraps them. Imports ``distributed`` (teardown) and
``_compat`` below it, never ``compiler``, ``stats`` or ``launch``.
"""
