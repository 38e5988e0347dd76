"""Where the host time of a compiled step goes: configs side by side in one process."""
import cProfile, io, os, pstats, statistics, sys, time, json

import torch, torch.distributed as dist
from bucketwise.benchmarks.tax_bench import build, _sync
from bucketwise.benchmarks.bench_models import make_spec
from torch.profiler import profile, ProfilerActivity

model = sys.argv[1]; configs = sys.argv[2].split(",")
for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", os.environ.get("MASTER_PORT", "29517")), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(k, v)
device = torch.device("cuda", 0); torch.cuda.set_device(device); torch.set_float32_matmul_precision("high")
dist.init_process_group("nccl", device_id=device)
spec = make_spec(model, {})
entries = {c: build(c, spec, device, "inductor", 3) for c in configs}
for c, e in entries.items():
    print(f"built {c}: first {e['first_step_s']:.1f}s rest {e['rest_bytes']/2**20:,.0f} MiB peak {e['first_peak_bytes']/2**20:,.0f} MiB", flush=True)
    if e.get("compile_breakdown"): print("   breakdown", json.dumps(e["compile_breakdown"]))
# phase timing: wrap loss.backward via module-level hooks is complex; time whole step issue, interleaved
res = {c: [] for c in configs}
for r in range(6):
    for c in (configs if r % 2 == 0 else configs[::-1]):
        _sync(); ts = []
        for _ in range(8):
            t = time.perf_counter(); entries[c]["step"](); ts.append((time.perf_counter() - t) * 1e3)
        _sync(); res[c].append(statistics.median(ts))
print("issue ms per round:", {c: [round(v, 2) for v in vs] for c, vs in res.items()}, flush=True)
base = configs[0]
for c in configs[1:]:
    print(f"ratio {c}/{base}: median {statistics.median(a/b for a, b in zip(res[c], res[base])):.3f}")
for c in configs:
    _sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3): entries[c]["step"]()
        _sync()
    ka = prof.key_averages()
    rows = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:30]
    print(f"\n[{c}] top self-CPU per step (us) / count per step")
    for e in rows:
        print(f"  {e.self_cpu_time_total/3:10.0f} {e.count/3:7.1f}  {e.key[:110]}")
for c in configs:
    pr = cProfile.Profile(); _sync(); pr.enable()
    for _ in range(3): entries[c]["step"]()
    _sync(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(f"\n[{c}] cProfile tottime (3 steps)\n" + "\n".join(s.getvalue().splitlines()[:60]))
dist.destroy_process_group()
