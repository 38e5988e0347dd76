"""Fixed host costs per step on one GPU (NCCL world 1): traced collectives, DDP's forward wrapper,
bucketwise's forward path, measured by interleaving A/B many times (median per-call us)."""
import os, time, statistics, torch, torch.nn as nn, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29611")
CUDA = torch.cuda.is_available()
dist.init_process_group("nccl" if CUDA else "gloo", rank=0, world_size=1, **({"device_id": torch.device("cuda:0")} if CUDA else {}))
import bucketwise
dev = torch.device("cuda:0" if CUDA else "cpu")
sync = torch.cuda.synchronize if CUDA else (lambda: None)
gname = dist.group.WORLD.group_name
def timeit(fn, n=200, reps=15):
    out = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        for _ in range(n): fn()
        out.append((time.perf_counter() - t) / n * 1e6)
        sync()
    return out
def ab(name, fns):
    res = {k: [] for k in fns}
    for r in range(7):
        for k, f in (fns.items() if r % 2 == 0 else reversed(list(fns.items()))):
            res[k] += timeit(f, reps=3)
    print(name, {k: round(statistics.median(v), 1) for k, v in res.items()}, flush=True)
bufs = [torch.zeros(n, device=dev) for n in ((41_500_000, 41_500_000, 41_500_000, 20_000_000) if CUDA else (1000,)*4)]
def coll4():
    for b in bufs: torch.ops._c10d_functional.all_reduce_(b, "avg", gname)
    for b in bufs: torch.ops._c10d_functional.wait_tensor(b)
def coll1():
    torch.ops._c10d_functional.all_reduce_(bufs[0], "avg", gname); torch.ops._c10d_functional.wait_tensor(bufs[0])
def eager4():
    for b in bufs: dist.all_reduce(b, op=dist.ReduceOp.AVG)
x = torch.randn(8, 64, device=dev)
def noop(): x.add_(0)
ab("collectives (us per call)", {"noop-kernel": noop, "functional 1": coll1, "functional 4": coll4, "eager dist.all_reduce 4": eager4})
class Tiny(nn.Module):
    def __init__(self):
        super().__init__(); self.a = nn.Linear(64, 64); self.b = nn.Linear(64, 64)
    def forward(self, x): return self.b(torch.relu(self.a(x)))
m = Tiny().to(dev)
ddp = torch.nn.parallel.DistributedDataParallel(Tiny().to(dev))
ddp_nosync = torch.nn.parallel.DistributedDataParallel(Tiny().to(dev))
local = torch.compile(Tiny().to(dev))
bw = bucketwise.compile(torch.nn.parallel.DistributedDataParallel(Tiny().to(dev)))
tc = torch.compile(torch.nn.parallel.DistributedDataParallel(Tiny().to(dev)))
xi = torch.randn(8, 64, device=dev, requires_grad=False)
for f in (local, bw, tc):
    for _ in range(3): f(xi).sum().backward()
def fwd(f): return lambda: f(xi)
ab("forward only, grad enabled (us)", {"module": fwd(m), "eager DDP": fwd(ddp), "local": fwd(local), "bw-auto": fwd(bw), "torch.compile(DDP)": fwd(tc)})
def step(f): return lambda: f(xi).sum().backward()
ab("forward+backward (us)", {"module": step(m), "eager DDP": step(ddp), "local": step(local), "bw-auto": step(bw), "torch.compile(DDP)": step(tc)})
with torch.no_grad():
    ab("forward, no_grad (us)", {"local": fwd(local), "bw-auto": fwd(bw)})
dist.destroy_process_group()
