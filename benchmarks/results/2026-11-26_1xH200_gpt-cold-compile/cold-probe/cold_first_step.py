"""Cold first step of one config on CUDA (fresh caches given by the caller): wall time,
torch's compile-phase metrics, optionally cProfile."""
import cProfile, json, os, pstats, sys, time
import torch, torch.distributed as dist
from bucketwise.benchmarks.bench_configs import recipe_for
from bucketwise.benchmarks.bench_models import make_spec
config, model_name, prof, out = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"file://{out}.store", rank=0, world_size=1, device_id=torch.device("cuda", 0))
spec = make_spec(model_name, {})
dev = torch.device("cuda", 0)
torch.manual_seed(0)
model = spec.build().to(dev)
prep = recipe_for(config).prepare(model, device=dev, backend="inductor", bucket_cap_mb=None)
batch = spec.make_batch(0, dev)
pr = cProfile.Profile() if prof else None
torch.cuda.synchronize()
t = time.perf_counter()
if pr: pr.enable()
with prep.step_context():
    with spec.autocast(dev):
        loss = spec.loss(prep.module, batch)
    fw = time.perf_counter() - t
    loss.backward()
torch.cuda.synchronize()
if pr: pr.disable()
first = time.perf_counter() - t
metrics = {k: round(sum(v), 3) for k, v in torch._dynamo.utils.compilation_time_metrics.items()}
from torch._dynamo.utils import counters
res = {"fx": dict(counters["inductor"].get("fxgraph_cache_hit") and {"hit": counters["inductor"]["fxgraph_cache_hit"]} or {}, miss=counters["inductor"].get("fxgraph_cache_miss", 0)), "aot": dict(counters["aot_autograd"]), "config": config, "model": model_name, "profiled": prof, "first_step_s": round(first, 3), "forward_s": round(fw, 3), "metrics": metrics}
print(json.dumps(res))
with open(out + ".jsonl", "a") as f: f.write(json.dumps(res) + "\n")
if pr:
    pr.dump_stats(out + ".prof")
    with open(out + ".txt", "w") as f:
        st = pstats.Stats(pr, stream=f); st.sort_stats("cumulative").print_stats(150)
        st.sort_stats("tottime").print_stats(60)
dist.destroy_process_group()
