"""The bottom floor: every private torch API bucketwise uses, one module per concern.

Each module names the torch versions it was checked on; nothing outside this folder touches
``torch._*`` (tests/unit/test_layers.py checks it), and these modules import only each other.
"""
