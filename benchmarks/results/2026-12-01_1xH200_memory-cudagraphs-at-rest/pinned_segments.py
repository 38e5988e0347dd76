"""At rest: the default pool's segments that hold free memory, and what pins each (python frames)."""
import gc, json, os, sys
import torch, torch.distributed as dist
from bucketwise.benchmarks.core.configs import recipe_for
from bucketwise.benchmarks.core.models import make_spec
from bucketwise.benchmarks.core.step import training_step
config, model, sizes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.cuda.set_device(0)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
torch.cuda.memory._record_memory_history(max_entries=500000, context="all", stacks="python")
m, prepared, opt, step = training_step(recipe_for(config), make_spec(model, sizes), torch.device("cuda", 0), "inductor")
for i in range(5):
    step(); torch.cuda.synchronize()
    print(f"after step {i}: reserved {torch.cuda.memory_reserved()/2**20:.0f} allocated {torch.cuda.memory_allocated()/2**20:.0f}")
gc.collect()
snap = torch.cuda.memory._snapshot()
M = 2**20
def fr(b):
    fs = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in b.get("frames", [])]
    keep = [f for f in fs if not f.startswith(("module.py", "graph.py", "_ops.py", "utils.py:"))]
    return " < ".join(keep[:5])
for seg in snap["segments"]:
    pool = tuple(seg.get("segment_pool_id", (0, 0)))
    free = seg["total_size"] - seg["allocated_size"]
    if free < 2 * M:
        continue
    print(f"segment pool {pool} total {seg['total_size']/M:.1f} allocated {seg['allocated_size']/M:.1f} free {free/M:.1f}")
    for b in seg["blocks"]:
        if b["size"] >= M // 2:
            print(f"   {b['state']:>18} {b['size']/M:7.1f}  {fr(b)}")
dist.destroy_process_group()
