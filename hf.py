"""bucketwise for the Hugging Face Trainer: :class:`BucketwiseTrainer`, the Trainer on ``fused``.

    from bucketwise.hf import BucketwiseTrainer

    trainer = BucketwiseTrainer(model=model, args=args, train_dataset=ds)   # instead of Trainer(...)

``with_bucketwise(SomeTrainer)`` does the same for a Trainer subclass of your own or of another
library (TRL's ``SFTTrainer``, ...). Needs ``transformers``; ``import bucketwise`` does not import
this module. Without a DDP module (one process) the model is compiled with
``bucketwise.compile(model)`` (no buckets), and the log says so.

NOTE [HF Trainer on fused]: ``fused`` needs bucketwise to run the DDP forward, but the Trainer
builds its DDP module inside ``train()`` with no public hook before its first call. The first
place that sees it is ``Trainer.compute_loss``: there, once per DDP module, what
``bucketwise.compile(ddp)`` builds is made and the module's forward routed to it
(``_compat/ddp.route_forward``), so the Trainer keeps its own objects. The Trainer asks DDP for
``find_unused_parameters=True`` by default, for which ``auto`` would pick ``split``; so unless
that or a ``strategy`` was set, the strategy is ``"fused"`` (NOTE [explicit strategies]).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import transformers

from ._compat import ddp as ddpc
from ._compat import dynamo as dc
from .compiler.api import compile as bucketwise_compile
from .compiler.config import CompileConfig
from .compiler.decision import decide_strategy, refusal
from .stats.report import report

log = logging.getLogger(__name__)

OPTION_NAMES = tuple(f.name for f in dataclasses.fields(CompileConfig))
"""Keys of ``bucketwise_options``: the keyword arguments of :func:`bucketwise.compile`."""


def check_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """``bucketwise_options`` as a new dict, checked as :func:`bucketwise.compile` checks them."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(
            f"bucketwise_options must be a dict of bucketwise.compile arguments, got {type(options).__name__}"
        )
    bad = sorted(set(options) - set(OPTION_NAMES))
    if bad:
        raise ValueError(f"bucketwise_options: unknown key(s) {bad}; accepted: {list(OPTION_NAMES)}")
    CompileConfig(**options)  # raises naming the bad value
    return dict(options)


class BucketwiseTrainerMixin:
    """Put before a ``transformers.Trainer`` class in the bases (NOTE [HF Trainer on fused]).

    Keyword argument ``bucketwise_options``: a dict of :func:`bucketwise.compile` arguments
    (``backend``, ``strategy``, ``cudagraphs``, ...); default: ``bucketwise.compile``'s own,
    with ``strategy="fused"`` as the note says.
    """

    def __init__(self, *args: Any, bucketwise_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        options = check_options(bucketwise_options)
        model = kwargs.get("model", args[0] if args else None)
        if model is not None and dc.uncompiled(model) is not model:
            raise ValueError(
                f"model: {type(self).__name__} compiles the model itself; pass the uncompiled model "
                "(model._orig_mod), not what torch.compile returned"
            )
        super().__init__(*args, **kwargs)
        if self.args.torch_compile:
            raise ValueError(
                f"args.torch_compile=True: {type(self).__name__} compiles the model with bucketwise; "
                "leave torch_compile off (bucketwise_options={'backend': ...} picks the backend)"
            )
        self._bucketwise_options = options
        self._bucketwise_plain: tuple[Any, Any] | None = None
        self._bucketwise_said: set[str] = set()

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return super().compute_loss(self._bucketwise_model(model), inputs, *args, **kwargs)

    # -- what compute_loss hands on ----------------------------------------------------------

    def _bucketwise_model(self, model: Any) -> Any:
        if ddpc.is_ddp(model):
            if ddpc.owner_of(model) is None:
                self._bucketwise_attach(model)
            return model
        training = model.training and torch.is_grad_enabled()
        if self.args.world_size > 1:
            if training:
                self._bucketwise_say(
                    "not-ddp",
                    logging.WARNING,
                    f"bucketwise: the Trainer trains a {type(model).__name__}, not a DistributedDataParallel module "
                    "(FSDP, DeepSpeed?); it runs uncompiled: bucketwise compiles DDP modules",
                )
            else:
                self._bucketwise_say(
                    "eval",
                    logging.INFO,
                    "bucketwise: the Trainer evaluates the model outside DDP; evaluation runs uncompiled",
                )
            return model
        return self._bucketwise_single(model)

    def _bucketwise_attach(self, ddp: Any) -> None:
        options = dict(self._bucketwise_options)
        chosen = "strategy" not in options and self.args.ddp_find_unused_parameters is not True
        if chosen:
            # fused where it applies to this DDP module now (a comm hook or gradient hooks it
            # cannot reproduce: auto, which runs split and says why in the report).
            options["strategy"] = "fused" if check_fused(ddp, options) else "auto"
        compiled = bucketwise_compile(ddp, **options)
        rep = report(compiled)
        rep.note(
            f"compiled by bucketwise.hf.{type(self).__name__}: bucketwise runs this DDP module's forward "
            "from the first step on (NOTE [HF Trainer on fused])"
        )
        if chosen and ddpc.find_unused_parameters(ddp):
            rep.note(
                "strategy 'fused' although the Trainer asked DDP for find_unused_parameters=True (its default "
                "without gradient checkpointing): ranks whose graphs read different parameters raise "
                "RankMismatchError; set ddp_find_unused_parameters=True yourself to get 'auto' (split)"
            )
        ddpc.route_forward(ddp, compiled)
        ddpc.set_owner(ddp.module, ddpc.owner_of(ddp))  # report(trainer.model) finds it
        log.info(
            "bucketwise: %s compiled by %s (strategy %s)",
            rep.target,
            type(self).__name__,
            options.get("strategy", "auto"),
        )

    def _bucketwise_single(self, model: Any) -> Any:
        """One process, no DDP module: the model compiled with the inner backend alone."""
        if self.label_smoother is not None:
            self._bucketwise_say(
                "smoothing",
                logging.WARNING,
                "bucketwise: one process with label_smoothing_factor: the model runs uncompiled (the Trainer "
                "picks its label smoothing by the model's class name)",
            )
            return model
        if self._bucketwise_plain is None or self._bucketwise_plain[0] is not model:
            options = dict(self._bucketwise_options)
            if options.get("strategy") in ("fused", "split"):
                self._bucketwise_say(
                    "single-strategy",
                    logging.WARNING,
                    f"bucketwise: strategy={options['strategy']!r} of bucketwise_options needs a DDP module; with one "
                    "process the Trainer has none, so the model is compiled whole (strategy 'auto')",
                )
            options["strategy"] = "auto"
            self._bucketwise_plain = (model, bucketwise_compile(model, **options))
            self._bucketwise_say(
                "single",
                logging.INFO,
                f"bucketwise: one process, no DDP module: {type(model).__name__} compiled with backend "
                f"{options.get('backend', 'inductor')!r} alone (no gradient buckets)",
            )
        return self._bucketwise_plain[1]

    def _bucketwise_say(self, key: str, level: int, text: str) -> None:
        if key not in self._bucketwise_said:
            self._bucketwise_said.add(key)
            log.log(level, text)

    def bucketwise_report(self) -> Any:
        """:func:`bucketwise.report` of the model this Trainer trains (after a training step)."""
        return report(self._bucketwise_plain[1] if self._bucketwise_plain is not None else self.model_wrapped)


def check_fused(ddp: Any, options: dict[str, Any]) -> bool:
    """Does ``strategy="fused"`` apply to ``ddp`` as it is now (NOTE [explicit strategies])?"""
    config = CompileConfig(**{**options, "strategy": "fused"})
    return refusal(config, decide_strategy(config, ddp, runs_ddp_forward=True), target="") is None


def with_bucketwise(trainer_class: type) -> type:
    """``trainer_class`` (a ``transformers.Trainer`` subclass) with :class:`BucketwiseTrainerMixin`."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"trainer_class must be transformers.Trainer or a subclass of it, got {trainer_class!r}")
    return type(f"Bucketwise{trainer_class.__name__}", (BucketwiseTrainerMixin, trainer_class), {})


class BucketwiseTrainer(BucketwiseTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` whose DDP module bucketwise compiles (NOTE [HF Trainer on fused])."""
