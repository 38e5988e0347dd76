"""At-rest memory breakdown of one config: reserved/allocated per memory pool, and the live
blocks with the frames that allocated them."""
import collections, gc, json, os, sys
import torch, torch.distributed as dist
from bucketwise.benchmarks.core.configs import recipe_for
from bucketwise.benchmarks.core.models import make_spec
from bucketwise.benchmarks.core.step import training_step

config, model, sizes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.cuda.set_device(0)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
torch.cuda.memory._record_memory_history(max_entries=200000)
gc.collect(); start_r = torch.cuda.memory_reserved(); start_a = torch.cuda.memory_allocated()
spec = make_spec(model, sizes)
m, prepared, opt, step = training_step(recipe_for(config), spec, torch.device("cuda", 0), "inductor")
for i in range(5):
    step()
torch.cuda.synchronize(); gc.collect()
snap = torch.cuda.memory._snapshot()
MIB = 2**20
pools = collections.defaultdict(lambda: [0, 0, 0])
live = collections.Counter()
for seg in snap["segments"]:
    pid = str(seg.get("segment_pool_id"))
    pools[pid][0] += seg["total_size"]; pools[pid][1] += seg["allocated_size"]; pools[pid][2] += 1
    for b in seg["blocks"]:
        if b["state"] == "active_allocated":
            frames = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in b.get("frames", [])
                      if "site-packages/torch" not in f["filename"] or "bucketwise" in f["filename"]][:4]
            live[(pid, b["size"] // MIB, " < ".join(frames))] += 1
print(f"== {config} {model} rest reserved {(torch.cuda.memory_reserved()-start_r)/MIB:.1f} allocated {(torch.cuda.memory_allocated()-start_a)/MIB:.1f} MiB; max reserved {torch.cuda.max_memory_reserved()/MIB:.1f}")
for pid, (t, a, n) in sorted(pools.items(), key=lambda kv: -kv[1][0]):
    print(f"pool {pid}: {n} segments, reserved {t/MIB:.1f} allocated {a/MIB:.1f}")
for (pid, mib, fr), n in sorted(live.items(), key=lambda kv: -kv[0][1] * kv[1])[:25]:
    print(f"  live pool {pid} {n} x {mib} MiB  {fr}")
try:
    from bucketwise import report
    cg = report(prepared.module).to_dict().get("cudagraphs")
    print("cudagraphs", json.dumps(cg)[:1500])
except Exception as e:
    print("no report", type(e).__name__, str(e)[:200])
dist.destroy_process_group()
