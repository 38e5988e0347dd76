"""Host cost of issuing one bucket collective, by path (world size 1, NCCL)."""
import os, statistics, sys, time
import torch, torch.distributed as dist
for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", os.environ.get("MASTER_PORT", "29519")), ("RANK", "0"), ("WORLD_SIZE", "1")):
    os.environ.setdefault(k, v)
dev = torch.device("cuda", 0); torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
from torch.distributed import _functional_collectives as fcol
g = str(fcol._resolve_group_name(dist.group.WORLD))
bufs = [torch.ones(6 << 20, device=dev) for _ in range(16)]
def c10d_async():
    ws = [dist.all_reduce(b, async_op=True) for b in bufs]
    for w in ws: w.wait()
def functional():
    for b in bufs: torch.ops._c10d_functional.all_reduce_.default(b, "sum", g)
    for b in bufs: torch.ops._c10d_functional.wait_tensor.default(b)
def functional_below():
    with torch._C._AutoDispatchBelowAutograd():
        functional()
def launches():  # 32 tiny kernels: the floor a launch costs here
    for b in bufs: b.mul_(1.0); b.add_(0.0)
modes = {"launch x2": launches, "c10d_async": c10d_async, "functional": functional, "functional_below_autograd": functional_below}
for f in modes.values():
    for _ in range(5): f()
torch.cuda.synchronize()
res = {m: [] for m in modes}
for r in range(7):
    for m, f in modes.items():
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(20): f()
        res[m].append((time.perf_counter() - t) / 20 / 16 * 1e6)
        torch.cuda.synchronize()
print(os.environ.get("TAG", "default"), {m: f"{statistics.median(v):.1f} us per bucket (issue+wait)" for m, v in res.items()}, flush=True)
dist.destroy_process_group()
