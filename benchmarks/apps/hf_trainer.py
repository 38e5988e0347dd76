"""HF Trainer on a small Llama (built from its config, synthetic tokens), four ways, as
docs/integrations-recipes.md describes them:

- ``fused``: ``bucketwise.hf.BucketwiseTrainer`` (bucketwise runs the DDP forward; one process:
  the model compiled with the inner backend alone);
- ``split``: ``Trainer(model=torch.compile(model, backend="bucketwise"))`` (DDP wraps the
  compiled model; one process: each graph compiled whole by the inner backend, strategy
  ``none``, with bucketwise's warning);
- ``torch_compile``: the Trainer's own ``TrainingArguments(torch_compile=True)`` (Inductor);
- ``eager``: no compile.

Per config: the loss of every step, the step times, steps per second (after the warm-up, and
the Trainer's own ``train_steps_per_second``, warm-up included), in one JSON file.

    python -m bucketwise.benchmarks hf-trainer --nproc 1 --out benchmarks/results/<run>/hf_trainer.json

Each config runs in its own ``torchrun`` job (the Trainer's accelerate state is per process);
this driver starts them one after the other and merges what their rank 0 writes. ``--tiny``:
sizes and backends for a CPU check (gloo, ``aot_eager``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bucketwise.benchmarks.core import procs
from bucketwise.benchmarks.core.meta import run_meta
from bucketwise.benchmarks.core.names import HF_TRAINER, check_names
from bucketwise.benchmarks.core.procs import ALWAYS_ENV
from bucketwise.distributed.gloo_exit import end_process_group

CONFIGS = HF_TRAINER
SIZES = {  # name: (hidden, intermediate, layers, heads, vocab, seq, batch per rank)
    "small": (1024, 2816, 4, 16, 32000, 512, 8),
    "tiny": (32, 64, 2, 4, 128, 16, 4),
}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (GPUs); 1: no DDP module, the Trainer trains alone")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the step-time statistics")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--inner-backend", default="inductor", help="bucketwise's inner_backend")
    p.add_argument("--compile-backend", default="inductor", help="torch_compile_backend of the torch_compile config")
    p.add_argument("--find-unused", action="store_true", help="ddp_find_unused_parameters=True (default False)")
    p.add_argument("--tiny", action="store_true", help="CPU check: --size tiny, aot_eager, 6 steps, 2 warm-up")
    p.add_argument("--out", required=True)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.size, args.inner_backend, args.compile_backend = "tiny", "aot_eager", "aot_eager"
        args.steps, args.warmup = min(args.steps, 6), min(args.warmup, 2)
    try:
        check_names(args.configs.split(","), CONFIGS)
    except ValueError as exc:
        p.error(str(exc))
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    return args


# --- one config, on every rank (under torchrun) ---------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    config_name = args.worker
    cuda = torch.cuda.is_available()
    hidden, inter, layers, heads, vocab, seq, batch = SIZES[args.size]

    class Tokens(torch.utils.data.Dataset):
        """Learnable synthetic sequences: an arithmetic progression of token ids per sample."""

        def __len__(self) -> int:
            return 1 << 20

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(i)
            start, stride = torch.randint(0, vocab, (1,), generator=g), torch.randint(1, 8, (1,), generator=g)
            ids = (start + stride * torch.arange(seq)) % vocab
            return {"input_ids": ids, "labels": ids.clone()}

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._t0 = 0.0

        def on_step_begin(self, *_, **__) -> None:
            if cuda:
                torch.cuda.synchronize()
            self._t0 = time.perf_counter()

        def on_step_end(self, *_, **__) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t0)

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=max(seq, 64),
        )
    )
    extra: dict = {}
    if config_name == "bw-split":
        model = torch.compile(model, backend="bucketwise", options={"inner_backend": args.inner_backend})
        extra["remove_unused_columns"] = False
    elif config_name == "torch":
        extra.update(torch_compile=True, torch_compile_backend=args.compile_backend)
    out_dir = Path(args.out).parent
    targs = TrainingArguments(
        output_dir=str(out_dir / f"trainer-{config_name}"),
        per_device_train_batch_size=batch,
        max_steps=args.steps,
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        bf16=cuda,
        use_cpu=not cuda,
        ddp_backend="nccl" if cuda else "gloo",
        ddp_find_unused_parameters=args.find_unused,
        dataloader_num_workers=0,
        **extra,
    )
    timer = StepTimes()
    trainer_class = Trainer
    kwargs: dict = {}
    if config_name == "bw-fused":
        from bucketwise.hf import BucketwiseTrainer

        trainer_class, kwargs = BucketwiseTrainer, {"bucketwise_options": {"backend": args.inner_backend}}
    trainer = trainer_class(model=model, args=targs, train_dataset=Tokens(), callbacks=[timer], **kwargs)
    metrics = trainer.train().metrics
    if trainer.args.process_index != 0:
        return
    measured = timer.times[args.warmup :]
    result = {
        "config": config_name,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "step_seconds": timer.times,
        "median_step_ms": round(1000 * statistics.median(measured), 3),
        "mean_step_ms": round(1000 * statistics.fmean(measured), 3),
        "steps_per_second": round(1 / statistics.fmean(measured), 3),
        "trainer_steps_per_second": metrics.get("train_steps_per_second"),
        "warmup_s": round(sum(timer.times[: args.warmup]), 3),
        "world_size": trainer.args.world_size,
        "compile": {
            "bw-fused": f"BucketwiseTrainer(..., bucketwise_options={{'backend': '{args.inner_backend}'}})",
            "bw-split": (
                f"torch.compile(model, backend='bucketwise', options={{'inner_backend': '{args.inner_backend}'}})"
            ),
            "torch": f"TrainingArguments(torch_compile=True, torch_compile_backend='{args.compile_backend}')",
            "eager": None,
        }[config_name],
    }
    if config_name in ("bw-fused", "bw-split"):
        result["bucketwise"] = _bucketwise_summary(trainer, config_name)
    Path(os.environ["HF_BENCH_WORKER_OUT"]).write_text(json.dumps(result))


def _bucketwise_summary(trainer, config_name: str) -> dict:
    """What bucketwise compiled (strategies, totals, notes); on one process there is no DDP
    module: strategy ``none`` (each graph whole, with the inner backend)."""
    import bucketwise

    try:
        rep = trainer.bucketwise_report() if config_name == "bw-fused" else bucketwise.report(trainer.model)
    except TypeError as exc:
        return {"report": None, "why": str(exc)}
    return {"strategies": [g.strategy for g in rep.graphs], "totals": rep.totals, "notes": rep.notes}


# --- driver -------------------------------------------------------------------------------


def meta(args: argparse.Namespace, argv: list[str]) -> dict:
    import torch
    import transformers

    try:
        import accelerate

        accelerate_version = accelerate.__version__
    except ImportError:
        accelerate_version = None
    cuda = torch.cuda.is_available()
    hidden, inter, layers, heads, vocab, seq, batch = SIZES[args.size]
    return {
        **run_meta(),
        "device": "cuda" if cuda else (platform.processor() or "cpu"),
        "nproc": args.nproc,
        "transformers": transformers.__version__,
        "accelerate": accelerate_version,
        "model": {
            "arch": "LlamaForCausalLM",
            "hidden": hidden,
            "intermediate": inter,
            "layers": layers,
            "heads": heads,
            "vocab": vocab,
            "seq": seq,
            "batch_per_rank": batch,
        },
        "steps": args.steps,
        "warmup": args.warmup,
        "bf16": cuda,
        "find_unused_parameters": args.find_unused,
        "env": dict(ALWAYS_ENV),
    }


def _worker_argv(argv: list[str]) -> list[str]:
    """``argv`` without ``--nproc`` (torchrun's parser would take it for an abbreviation of its
    own ``--nproc-per-node``, even after the script, and stop: "ambiguous option")."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


NO_ENTRY_POINT = (
    "backend='bucketwise' is found through the installed package's torch_dynamo_backends entry "
    "point, and no installed distribution declares it: run `pip install -e .` (or install the wheel) first"
)


def _backend_entry_point() -> bool:
    """Whether ``torch.compile(backend="bucketwise")`` can find the backend by name (the package
    is installed, not only importable from a source folder)."""
    return any(ep.name == "bucketwise" for ep in importlib.metadata.entry_points(group="torch_dynamo_backends"))


def drive(args: argparse.Namespace, argv: list[str]) -> dict:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"meta": meta(args, argv), "configs": {}}
    for name in args.configs.split(","):
        if name == "bw-split" and not _backend_entry_point():
            report["configs"][name] = {"config": name, "error": NO_ENTRY_POINT}
            print(f"[hf-trainer] bw-split: not run: {NO_ENTRY_POINT}", flush=True)
            out.write_text(json.dumps(report, indent=1))
            continue
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            worker_out = f.name
        job = procs.torchrun(
            str(Path(__file__).resolve()), nproc=args.nproc, script_args=[*_worker_argv(argv), "--worker", name]
        )
        job = dataclasses.replace(job, env={"HF_BENCH_WORKER_OUT": worker_out, "HF_HUB_OFFLINE": "1"})
        print(f"[hf-trainer] {name}: {shlex.join(job.argv)}", flush=True)
        proc = procs.run([job], capture=procs.Capture.STDERR)
        sys.stderr.write(proc.stderr[-20000:])
        text = Path(worker_out).read_text() if os.path.getsize(worker_out) else ""
        os.unlink(worker_out)
        # A config that fails (e.g. Dynamo stopping in DDP's forward) is recorded, the others still run.
        report["configs"][name] = (
            json.loads(text)
            if proc.code == 0 and text
            else {"config": name, "error": f"exit code {proc.code}", "stderr_tail": proc.stderr[-4000:]}
        )
        out.write_text(json.dumps(report, indent=1))
    eager = report["configs"].get("eager")
    for name, result in report["configs"].items():
        if "error" in result:
            print(f"[hf-trainer] {name}: FAILED ({result['error']}), see stderr_tail in {out}", flush=True)
            continue
        if eager is not None and "error" not in eager and name != "eager":
            diffs = [abs(a - b) for a, b in zip(result["losses"], eager["losses"])]
            result["max_abs_loss_diff_vs_eager"] = max(diffs) if diffs else None
        print(
            f"[hf-trainer] {name}: median step {result['median_step_ms']} ms, "
            f"{result['steps_per_second']} steps/s after warm-up, "
            f"warm-up {result['warmup_s']} s, final loss {result['losses'][-1]:.4f}",
            flush=True,
        )
    out.write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.worker is not None:
        try:
            worker(args)
        finally:
            # What the Trainer leaves to the script (docs/troubleshooting.md, "CPU ranks (gloo)").
            end_process_group()
    else:
        drive(args, argv)


if __name__ == "__main__":
    main()
