"""One-rank GPU probe: static memory per config, interleaved step timing, peak breakdown."""
import os, sys, time, json, statistics, collections, datetime, argparse
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29511")
os.environ.setdefault("RANK", "0"); os.environ.setdefault("WORLD_SIZE", "1"); os.environ.setdefault("LOCAL_RANK", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
import torch, torch.distributed as dist
from bench_configs import CONFIGS, Recipe
from bench_models import make_spec
import ddp_bench

ap = argparse.ArgumentParser(); ap.add_argument("--model", default="gpt-medium"); ap.add_argument("--configs", default="local,torch-nosplit,bw-fused")
ap.add_argument("--pairs", type=int, default=4); ap.add_argument("--steps", type=int, default=5); ap.add_argument("--snapshot", default="")
args = ap.parse_args()
dev = torch.device("cuda", 0); torch.cuda.set_device(dev); torch.set_float32_matmul_precision("high")
dist.init_process_group("nccl", device_id=dev)
spec = make_spec(args.model, {})
names = args.configs.split(",")
built = {}
def alloc(): torch.cuda.synchronize(); return torch.cuda.memory_allocated()
for name in names:
    r = CONFIGS[name]
    a0 = alloc()
    torch.manual_seed(0)
    model = spec.build().to(dev)
    a1 = alloc()
    prepared = r.prepare(model, device=dev, backend="inductor", bucket_cap_mb=None)
    a2 = alloc()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = spec.make_batch(1, dev)
    step = ddp_bench.make_step(prepared, spec, opt, batch, dev, mark_cudagraph_step=r.mode == "reduce-overhead", annotate=False)
    t = time.perf_counter(); step(); torch.cuda.synchronize(); first = time.perf_counter() - t
    for _ in range(3): step()
    a3 = alloc()
    built[name] = dict(step=step, model=model, params_mib=(a1-a0)/2**20, wrap_mib=(a2-a1)/2**20, rest_mib=(a3-a0)/2**20, first_s=first)
    print(f"built {name}: params {(a1-a0)/2**20:.0f} MiB, wrap +{(a2-a1)/2**20:.0f}, at rest after steps {(a3-a0)/2**20:.0f} MiB, first step {first:.1f}s", flush=True)
total_rest = alloc()
res = collections.defaultdict(lambda: dict(issue=[], step=[], peak=[]))
for p in range(args.pairs):
    order = names if p % 2 == 0 else names[::-1]
    for name in order:
        b = built[name]; step = b["step"]
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        s0 = torch.cuda.Event(enable_timing=True); s1 = torch.cuda.Event(enable_timing=True)
        issue = []; s0.record()
        for _ in range(args.steps):
            t = time.perf_counter(); step(); issue.append((time.perf_counter() - t) * 1e3)
        s1.record(); torch.cuda.synchronize()
        res[name]["issue"].append(statistics.median(issue)); res[name]["step"].append(s0.elapsed_time(s1) / args.steps)
        others = total_rest - b["rest_mib"] * 2**20
        res[name]["peak"].append((torch.cuda.max_memory_allocated() - others) / 2**20)
print("\nconfig            rest MiB  wrap MiB  peak MiB   issue ms (per pair)              step ms")
for name in names:
    r = res[name]; b = built[name]
    print(f"{name:16s} {b['rest_mib']:8.0f} {b['wrap_mib']:8.0f} {max(r['peak']):9.0f}   {' '.join(f'{x:6.2f}' for x in r['issue'])}   {' '.join(f'{x:6.2f}' for x in r['step'])}")
base = names[0]
for name in names[1:]:
    ratios = [a / b for a, b in zip(res[name]["issue"], res[base]["issue"])]
    print(f"issue ratio {name}/{base}: median {statistics.median(ratios):.3f} pairs {[round(x,3) for x in ratios]}")
# profiler: host cost per launch
from torch.profiler import profile, ProfilerActivity
for name in names:
    step = built[name]["step"]; torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3): step()
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    gpu = 0.0; nk = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu += e.device_time; nk += 1
        else:
            agg[e.name][0] += 1; agg[e.name][1] += e.cpu_time_total
    top = sorted(((k, v) for k, v in agg.items() if k in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "aten::mm", "aten::empty_strided", "cudaMemcpyAsync", "aten::addmm", "cudaEventRecord", "cudaStreamWaitEvent", "cudaEventQuery", "aten::copy_", "aten::cat")), key=lambda kv: -kv[1][1])
    print(f"\n[{name}] per step: GPU kernel time {gpu/3/1e3:.2f} ms, kernels {nk/3:.0f}; host calls: " + ", ".join(f"{k} n={v[0]//3} {v[1]/v[0]:.1f}us" for k, v in top))
if args.snapshot:
    for name in names:
        step = built[name]["step"]; torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=400000)
        step(); torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot(); torch.cuda.memory._record_memory_history(enabled=None)
        ev = snap["device_traces"][0]
        live = {}; cur = 0; peak = 0; peak_i = -1
        for i, e in enumerate(ev):
            if e["action"] == "alloc": live[e["addr"]] = e; cur += e["size"]
            elif e["action"] == "free_completed" and e["addr"] in live: cur -= live.pop(e["addr"])["size"]
            if cur > peak: peak, peak_i = cur, i
        live = {}
        for e in ev[: peak_i + 1]:
            if e["action"] == "alloc": live[e["addr"]] = e
            elif e["action"] == "free_completed": live.pop(e["addr"], None)
        groups = collections.Counter()
        for e in live.values():
            fr = [f for f in e.get("frames", []) if f["filename"].endswith(".py")]
            key = " < ".join(f"{os.path.basename(f['filename'])}:{f['name']}" for f in fr[:3]) or "(no python frame)"
            groups[key] += e["size"]
        print(f"\n[{name}] live at the step's peak (above what was live before the step started, allocations made inside this step): {peak/2**20:.0f} MiB")
        for k, v in groups.most_common(12):
            print(f"  {v/2**20:8.0f} MiB  {k}")
dist.destroy_process_group()
