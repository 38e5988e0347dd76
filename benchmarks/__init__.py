"""The benchmarks (``bucketwise.benchmarks``): run each script from the repository root, e.g.
``python3 benchmarks/tax_bench.py --help``; they import the installed package, siblings
included. benchmarks/README.md says what each measures; results live in benchmarks/results/."""
