"""The benchmarks (``bucketwise.benchmarks``), behind one command: ``python -m bucketwise.benchmarks``
lists the harnesses, ``python -m bucketwise.benchmarks tax --help`` shows one. They import the
installed package; benchmarks/README.md says what each measures; results live in
benchmarks/results/, one folder per run with its command."""
