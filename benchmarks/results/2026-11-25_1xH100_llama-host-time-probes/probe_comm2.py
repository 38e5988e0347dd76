"""Per-collective host cost: shallow vs deep Python stack, idle vs busy GPU."""
import os, statistics, time
import torch, torch.distributed as dist
for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29523"), ("RANK", "0"), ("WORLD_SIZE", "1")):
    os.environ.setdefault(k, v)
dev = torch.device("cuda", 0); torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
from torch.distributed import _functional_collectives as fcol
g = str(fcol._resolve_group_name(dist.group.WORLD))
bufs = [torch.ones(6 << 20, device=dev) for _ in range(16)]
a = torch.randn(8192, 8192, device=dev)
def functional():
    for b in bufs: torch.ops._c10d_functional.all_reduce_.default(b, "sum", g)
    for b in bufs: torch.ops._c10d_functional.wait_tensor.default(b)
def launches():
    for b in bufs: b.mul_(1.0); b.add_(0.0)
def deep(f, n=60):
    return f() if n == 0 else deep(f, n - 1)
res = {}
for busy in (False, True):
    for depth in (0, 60):
        for name, f in (("functional", functional), ("launch x2", launches)):
            ts = []
            for r in range(9):
                torch.cuda.synchronize()
                if busy:
                    for _ in range(3): a @ a   # ~10 ms of GPU work queued ahead
                t = time.perf_counter()
                for _ in range(5): deep(f, depth)
                ts.append((time.perf_counter() - t) / 5 / 16 * 1e6)
            torch.cuda.synchronize()
            res[f"{name} busy={busy} depth={depth}"] = round(statistics.median(ts[2:]), 1)
for k, v in res.items(): print(os.environ.get("TAG", "default"), k, v, "us per bucket", flush=True)
dist.destroy_process_group()
