"""What one config launches per training step beyond another: CUDA kernels and events, and the
CPU ops that copy or accumulate gradients (one rank, one GPU).

    python -m bucketwise.benchmarks probe step_kernels [--model gpt] [--configs bw-fused,bw-fused-cg]

Prints per config the CPU ops of ``CPU_OPS`` per step, bucketwise's CUDA-graph counters where it
has them, the CUDA events and GPU ms per step, then the 25 kernel names whose count per step
differs most between the two configs. Behind the fix that stopped AccumulateGrad from copying
gradients lent by CUDA-graph replays (``tests/gpu/test_gpu_grad_memory.py`` guards it now).
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from bucketwise.benchmarks.core.configs import recipe_for
from bucketwise.benchmarks.core.models import MODELS, make_spec
from bucketwise.benchmarks.core.step import training_step
from bucketwise.benchmarks.probes._one_rank import one_rank

CPU_OPS = ("aten::clone", "aten::copy_", "aten::detach", "torch::autograd::AccumulateGrad", "aten::empty_strided")
CUDAGRAPH_STATS = ("name", "replays", "records", "inputs_in_place", "inputs_copied", "uncaptured_runs", "note")
STEPS = 2


def profile_config(config: str, model: str, device: torch.device) -> collections.Counter:
    _, prepared, _, step = training_step(recipe_for(config), make_spec(model, {}), device, "inductor")
    for _ in range(3):  # compile, record, warm
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    events = prof.events()
    cuda = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    cpu = collections.Counter(e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU)
    print(config, "CPU ops per step", {k: cpu[k] / STEPS for k in CPU_OPS if cpu[k]})
    if prepared.report is not None:
        for graph in prepared.report.to_dict().get("cudagraphs", []):
            print({k: graph.get(k) for k in CUDAGRAPH_STATS})
    gpu_ms = sum(e.device_time for e in cuda) / STEPS / 1e3
    print(config, "CUDA events per step", len(cuda) / STEPS, "GPU ms per step", round(gpu_ms, 3))
    return collections.Counter(e.name[:90] for e in cuda)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", choices=sorted(MODELS))
    p.add_argument("--configs", default="bw-fused,bw-fused-cg", help="two configs, comma-separated")
    args = p.parse_args(argv)
    configs = args.configs.split(",")
    if len(configs) != 2:
        p.error(f"--configs: expected two configs, got {configs}")
    with one_rank(p, configs, port=29577) as device:
        a, b = (profile_config(c, args.model, device) for c in configs)
    diff = {k: (a[k] / STEPS, b[k] / STEPS) for k in set(a) | set(b) if a[k] != b[k]}
    print(f"{configs[0]:>10} {configs[1]:>10}  kernel (per step)")
    for name, (x, y) in sorted(diff.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))[:25]:
        print(f"{x:10.1f} {y:10.1f}  {name}")
    return 0
