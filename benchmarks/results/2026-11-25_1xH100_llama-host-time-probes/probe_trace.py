"""Chrome traces of two steps per config, side by side in one process."""
import gzip, os, shutil, sys, time

import torch, torch.distributed as dist
from bucketwise.benchmarks.tax_bench import build, _sync
from bucketwise.benchmarks.bench_models import make_spec
from torch.profiler import profile, ProfilerActivity

model = sys.argv[1]; configs = sys.argv[2].split(","); out = sys.argv[3]
for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29518"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(k, v)
device = torch.device("cuda", 0); torch.cuda.set_device(device); torch.set_float32_matmul_precision("high")
dist.init_process_group("nccl", device_id=device)
spec = make_spec(model, {})
entries = {c: build(c, spec, device, "inductor", 3) for c in configs}
for c in configs:
    for _ in range(3): entries[c]["step"]()
    _sync()
    acts = [ProfilerActivity.CUDA] if os.environ.get("ACT") == "cuda" else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        for _ in range(2): entries[c]["step"]()
        _sync()
    path = os.path.join(out, f"trace-{model}-{c}{os.environ.get('ACT', '')}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g: shutil.copyfileobj(f, g)
    os.remove(path)
    print(c, os.path.getsize(path + ".gz"), flush=True)
dist.destroy_process_group()
