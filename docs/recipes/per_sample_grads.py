import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

import bucketwise

model = nn.Linear(8, 1)
params = {k: v.detach() for k, v in model.named_parameters()}


def loss(p, x, y):
    return ((functional_call(model, p, (x,)) - y) ** 2).mean()


per_sample_grads = bucketwise.compile(vmap(grad(loss), in_dims=(None, 0, 0)), fullgraph=True)
g = per_sample_grads(params, torch.randn(16, 8), torch.randn(16, 1))
print({k: tuple(v.shape) for k, v in g.items()})  # {'weight': (16, 1, 8), 'bias': (16, 1)}
print(bucketwise.report(per_sample_grads).totals["graphs"])  # 1
