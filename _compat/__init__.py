"""The bottom floor: every private torch API bucketwise uses, one module per concern.

``dynamo`` (Dynamo, AOTAutograd, Inductor, fake tensors), ``storage`` (tensor and storage
identity, memory a CUDA graph owns), ``ddp`` (DistributedDataParallel's
private attributes and reducer), ``collectives`` (functional collectives, Inductor's
comm/compute reordering), ``autograd`` (the autograd engine), ``c10d`` (process-group
internals), ``ops`` (operators registered with the dispatcher). Each names the torch versions it
was checked on; nothing outside this folder touches ``torch._*`` (tests/unit/test_layers.py
checks it), and these modules import nothing of bucketwise but each other.
"""
