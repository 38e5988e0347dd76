"""Issue time of local vs bw-fused with DDP's buckets vs one bucket, interleaved."""
import os, statistics, sys, time

import torch, torch.distributed as dist
from bucketwise.benchmarks.bench_configs import CONFIGS
from bucketwise.benchmarks.bench_models import make_spec
from bucketwise.benchmarks.ddp_bench import LR, make_step
model = sys.argv[1]
for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29520"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(k, v)
dev = torch.device("cuda", 0); torch.cuda.set_device(dev); torch.set_float32_matmul_precision("high")
dist.init_process_group("nccl", device_id=dev)
spec = make_spec(model, {})
def build(cfg, cap):
    torch.manual_seed(0)
    m = spec.build().to(dev)
    prep = CONFIGS[cfg].prepare(m, device=dev, backend="inductor", bucket_cap_mb=cap)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, fused=True)
    step = make_step(prep, spec, opt, spec.make_batch(1, dev), dev, mark_cudagraph_step=False, annotate=False)
    for _ in range(4): step()
    return step
entries = {n: build(c, cap) for n, c, cap in (("local", "local", None), ("bw-fused", "bw-fused", None), ("bw-fused-1b", "bw-fused", 4000.0))}
res = {n: [] for n in entries}
for r in range(8):
    for n in (list(entries) if r % 2 == 0 else list(entries)[::-1]):
        torch.cuda.synchronize(); ts = []
        for _ in range(8):
            t = time.perf_counter(); entries[n](); ts.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize(); res[n].append(statistics.median(ts))
print(os.environ.get("TAG", "default"), model, {n: round(statistics.median(v), 2) for n, v in res.items()},
      {n: round(statistics.median(a / b for a, b in zip(v, res["local"])), 3) for n, v in res.items()}, flush=True)
dist.destroy_process_group()
