"""Which CUDA events and copy ops ``bw-fused-cg`` launches beyond ``bw-fused`` (one rank, one
GPU): ``python3 <this file> gpt|llama`` from the repository root. Output: probe-kernels.txt."""

from __future__ import annotations

import collections
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from bucketwise.benchmarks import tax_bench as tb
from bucketwise.benchmarks.bench_models import make_spec

CPU_OPS = ("aten::clone", "aten::copy_", "aten::detach", "torch::autograd::AccumulateGrad", "aten::empty_strided")
STATS = ("name", "replays", "records", "inputs_in_place", "inputs_copied", "uncaptured_runs", "note")


def profile_config(config: str, spec, dev: torch.device) -> collections.Counter:
    e = tb.build(config, spec, dev, "inductor", 3)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            e["step"]()
        torch.cuda.synchronize()
    events = prof.events()
    ev = [x for x in events if x.device_type == torch.autograd.DeviceType.CUDA]
    cpu = collections.Counter(x.name for x in events if x.device_type == torch.autograd.DeviceType.CPU)
    print(config, "cpu ops/step", {k: cpu[k] / 2 for k in CPU_OPS if cpu[k]})
    if e.get("report") is not None:
        for cg in e["report"].to_dict().get("cudagraphs", []):
            print({k: cg[k] for k in STATS})
    print(config, "events/step", len(ev) / 2, "gpu ms/step", sum(x.device_time for x in ev) / 2e3)
    return collections.Counter(x.name[:90] for x in ev)


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    spec = make_spec(sys.argv[1] if len(sys.argv) > 1 else "gpt", {})
    dev = torch.device("cuda")
    a, b = (profile_config(c, spec, dev) for c in ("bw-fused", "bw-fused-cg"))
    diff = {k: (a[k] / 2, b[k] / 2) for k in set(a) | set(b) if a[k] != b[k]}
    for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))[:25]:
        print(f"{v[0]:7.1f} {v[1]:7.1f}  {k}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
