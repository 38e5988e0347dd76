import os, sys, time, json
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
sys.path.insert(0, "benchmarks")  # run from the repository root
import torch, torch.distributed as dist
from bench_configs import CONFIGS
from bench_models import make_spec
import ddp_bench, bucketwise
dev = torch.device("cuda", 0); torch.cuda.set_device(dev); torch.set_float32_matmul_precision("high")
dist.init_process_group("nccl", device_id=dev)
spec = make_spec(sys.argv[1], {})
for name in sys.argv[2].split(","):
    torch._dynamo.reset(); torch.cuda.empty_cache()
    a0 = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0); model = spec.build().to(dev)
    r = CONFIGS[name]; prep = r.prepare(model, device=dev, backend="inductor", bucket_cap_mb=None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = spec.make_batch(1, dev)
    step = ddp_bench.make_step(prep, spec, opt, batch, dev, mark_cudagraph_step=False, annotate=False)
    t = time.perf_counter(); step(); torch.cuda.synchronize(); first = time.perf_counter() - t
    for _ in range(4): step()
    torch.cuda.synchronize()
    rest = (torch.cuda.memory_allocated() - a0) / 2**20
    # one more forward/backward, grads kept: how many distinct storages hold them?
    with spec.autocast(dev):
        loss = spec.loss(prep.module, batch)
    loss.backward(); torch.cuda.synchronize()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    storages = {g.untyped_storage().data_ptr() for g in grads}
    with_grads = (torch.cuda.memory_allocated() - a0) / 2**20
    opt.zero_grad(set_to_none=True)
    d = bucketwise.report(prep.module).to_dict()
    cg = [{k: c[k] for k in ("name", "captured", "replays", "records", "uncaptured_runs", "uncaptured_reasons", "pool_bytes", "inputs_in_place", "inputs_copied")} for c in d.get("cudagraphs", [])]
    times = d["totals"].get("compile_times")
    print(json.dumps({"config": name, "first_step_s": round(first, 2), "peak_mib": round((torch.cuda.max_memory_allocated() - a0) / 2**20), "rest_mib": round(rest), "with_grads_mib": round(with_grads), "grads": len(grads), "grad_storages": len(storages), "compile_times": times, "cudagraphs": cg}, indent=None), flush=True)
    del prep, model, opt, step, grads; torch._dynamo.reset()
dist.destroy_process_group()
