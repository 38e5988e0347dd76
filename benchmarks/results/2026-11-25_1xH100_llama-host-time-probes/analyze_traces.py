import gzip, json, sys, collections
def load(p):
    d = json.load(gzip.open(p))
    return [e for e in d["traceEvents"] if e.get("ph") == "X"]
for name in ("local", "bw-fused"):
    ev = load(f"trace-llama-{name}-cuda-only.json.gz")
    cpu = [e for e in ev if e.get("cat") in ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")]
    gpu = [e for e in ev if e.get("cat") == "kernel" or e.get("cat") == "gpu_memcpy" or e.get("cat") == "gpu_memset"]
    # per thread: time span
    threads = collections.defaultdict(list)
    for e in cpu: threads[e["tid"]].append(e)
    print("==", name)
    for tid, es in threads.items():
        t0 = min(e["ts"] for e in es); t1 = max(e["ts"] + e["dur"] for e in es)
        print(f"  tid {tid}: {len(es)} events span {(t1-t0)/1e3:.2f} ms")
    rt = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in rt: agg[e["name"]][0] += 1; agg[e["name"]][1] += e["dur"]
    for k, (n, d) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"   {k:40s} n={n:5d} total={d/1e3:8.2f} ms  mean={d/n:7.1f} us  max={max(e['dur'] for e in rt if e['name']==k):8.1f}")
    g0 = min(e["ts"] for e in gpu); g1 = max(e["ts"] + e["dur"] for e in gpu)
    busy = sum(e["dur"] for e in gpu)
    print(f"  gpu span {(g1-g0)/1e3:.2f} ms busy {busy/1e3:.2f} ms")
    # longest cpu ops
    ops = sorted([e for e in cpu if e.get("cat") == "cpu_op"], key=lambda e: -e["dur"])[:1]
