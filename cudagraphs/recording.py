"""What one CUDA-graph recording holds, how it reads its inputs, and what a runner counts
(cudagraphs/runner.py drives them and holds their NOTEs)."""

from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import Any, Sequence

import torch

from .._compat import dynamo as dc
from .._compat import storage as st


@dataclasses.dataclass
class CudaGraphStats:
    """One wrapped graph: a segment's forward, backward or inference graph."""

    name: str
    captured: bool = False
    """At least one recording is live and replaying."""
    reason: str | None = None
    """Why it does not replay from a CUDA graph (``None`` while it does or may)."""
    replays: int = 0
    records: int = 0
    warmups: int = 0
    uncaptured_runs: int = 0
    """Calls after the warm-up that ran uncaptured (reasons counted in ``uncaptured_reasons``)."""
    uncaptured_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    pool_bytes: int = 0
    """Bytes the allocator reserved for this graph's captures (their memory pools)."""
    inputs_in_place: int = 0
    """Latest recording: tensor inputs read in place (parameters, buffers, other graphs' outputs)."""
    inputs_copied: int = 0
    """Latest recording: tensor inputs copied into a static buffer on every replay."""
    note: str | None = None
    """What a replay costs beyond the launch, where something does (gradients copied out)."""

    def ran_uncaptured(self, why: str) -> None:
        self.uncaptured_runs += 1
        self.uncaptured_reasons[why] = self.uncaptured_reasons.get(why, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(eq=False)
class Recording:
    graph: Any
    pool: Any
    """The memory pool it captured into (a backward that joined its forward: the forward's)."""
    inputs: list[Any]  # the copy buffers at copy_idxs (None elsewhere: no reference is kept to
    # tensors read in place, their owners' use counts stay exact, see NOTE [cudagraph replay safety])
    copy_idxs: list[int]
    """Inputs copied into inputs[i] on every call."""
    stable_idxs: list[int]
    """Inputs used in place; their address is checked on every call."""
    stable_ptrs: list[int]
    param_idxs: frozenset[int]
    """The stable inputs that are parameters or buffers (the others are other graphs' outputs)."""
    outputs: list[Any]
    clone_idxs: list[int]
    """Outputs returned to autograd or the caller: cloned at each replay, unless lent."""
    held_idxs: list[int]
    """Outputs lent out (or handed out as is): checked free before the next replay."""
    lent_idxs: frozenset[int]
    """The returned outputs that go out uncopied (:func:`lendable`), until one is found still in
    use at a replay that would overwrite it (NOTE [cudagraph replay safety])."""
    held_use: list[int] = dataclasses.field(default_factory=list)
    held_storage: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """Distinct (storage cdata, use count) of the held outputs when nobody else holds them."""
    returned_storage: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(storage cdata, use count) of the returned outputs when nobody else holds them."""
    backward: "tuple[Any, Recording] | None" = None
    """A forward: the backward recorded into its pool."""
    forward: "weakref.ref[Recording] | None" = None
    """A backward recorded into its forward's pool: that forward."""
    consumed: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    """A backward in its forward's pool: (input index, tensor and storage use counts at the
    capture) of the activations it frees as it reads them."""

    def count_held(self) -> None:
        """Take the use counts of the held outputs as they are now (held by this recording only)."""
        outs = self.outputs
        self.held_use = [st.tensor_use_count(outs[i]) for i in self.held_idxs]
        cdatas = dict.fromkeys(st.storage_cdata(outs[i]) for i in self.held_idxs)
        self.held_storage = [(c, st.storage_use_count(c)) for c in cdatas]

    def count_returned(self) -> None:
        """Take the use counts of the returned outputs as they are now (held by this recording only)."""
        cdatas = dict.fromkeys(st.storage_cdata(self.outputs[i]) for i in self.clone_idxs)
        self.returned_storage = [(c, st.storage_use_count(c)) for c in cdatas]

    def held_elsewhere(self) -> bool:
        """Whether anyone besides this recording still holds a held output (or a view of one)."""
        outs = self.outputs
        for i, use in zip(self.held_idxs, self.held_use):
            if st.tensor_use_count(outs[i]) > use:
                return True
        return any(st.storage_use_count(cdata) > use for cdata, use in self.held_storage)

    def returned_held(self) -> bool:
        """Whether a returned output handed out uncopied is still in use (checked after lending
        stops too, for those already out)."""
        return any(st.storage_use_count(cdata) > use for cdata, use in self.returned_storage)


@dataclasses.dataclass(eq=False)
class Plan:
    """How one recording reads its inputs, worked out before the capture consumes them."""

    inputs: list[Any]  # what the capture reads: copy buffers at copy_idxs, the inputs elsewhere
    buffers: list[Any]  # the copy buffers at copy_idxs, None elsewhere
    copy_idxs: list[int]
    stable_idxs: list[int]
    stable_ptrs: list[int]
    param_idxs: frozenset[int]
    input_ptrs: set[int]
    """Storage addresses of the tensor inputs that outlive the capture (an output there is an
    input handed back); the consumed ones are left out by :meth:`hand_over`: the capture frees
    them and may put outputs at the same addresses."""
    copy_ptrs: set[int]  # storage addresses of the copy buffers
    consumed: dict[int, int] = dataclasses.field(default_factory=dict)
    """Inputs that are saved activations of the forward whose pool this capture joins: input
    index -> that output's index in the forward."""
    keep: list[Any] = dataclasses.field(default_factory=list)
    """The inputs again, but None for the consumed ones (set by :meth:`hand_over`)."""

    def hand_over(self) -> None:
        """Keep every input but the consumed ones for a run after the capture."""
        self.keep = [None if i in self.consumed else a for i, a in enumerate(self.inputs)]
        self.input_ptrs = {a.untyped_storage().data_ptr() for a in self.keep if isinstance(a, torch.Tensor)}

    def recording(
        self, graph: Any, pool: Any, outputs: list[Any], clone_idxs: list[int], held_idxs: list[int]
    ) -> Recording:
        """What the capture of this plan into ``graph`` records (the held outputs' use counts as now)."""
        rec = Recording(
            graph=graph,
            pool=pool,
            inputs=self.buffers,
            copy_idxs=self.copy_idxs,
            stable_idxs=self.stable_idxs,
            stable_ptrs=self.stable_ptrs,
            param_idxs=self.param_idxs,
            outputs=outputs,
            clone_idxs=clone_idxs,
            held_idxs=held_idxs,
            lent_idxs=lendable(outputs, clone_idxs),
        )
        rec.count_held()
        rec.count_returned()
        return rec

    def call_args(self, forward: "Recording | None") -> list[Any]:
        """After the capture, the consumed activations as aliases of the same memory."""
        args = list(self.keep)
        for i, j in self.consumed.items():
            args[i] = forward.outputs[j]
        return args


LEND_MIN_BYTES = 1 << 20
"""Returned outputs smaller than this are cloned: a copy costs one small kernel, and a caller
keeps a loss through the backward and often past the next step."""


def lendable(outputs: list[Any], returned: list[int]) -> frozenset[int]:
    """The returned outputs a replay hands out uncopied: large ones whose memory no other output
    shares (a saved activation returned too is read by the backward)."""
    bases = collections.Counter(o.untyped_storage().data_ptr() for o in outputs if isinstance(o, torch.Tensor))
    return frozenset(
        i
        for i in returned
        if bases[outputs[i].untyped_storage().data_ptr()] == 1
        and outputs[i].untyped_storage().nbytes() >= LEND_MIN_BYTES
    )


def is_param(i: int, a: torch.Tensor, static_idxs: frozenset[int]) -> bool:
    """Input ``i`` is a parameter or buffer (read in place, at a fixed address)."""
    return i in static_idxs or dc.has_static_address(a)


def reads_in_place(i: int, a: torch.Tensor, static_idxs: frozenset[int], stable: set[int]) -> bool:
    """Parameters, buffers and other recordings' outputs are read in place, not copied."""
    return is_param(i, a, static_idxs) or a.data_ptr() in stable


def refusal(args: list[Any], static_idxs: frozenset[int], mutated: dict[int, str], stable: set[int]) -> str | None:
    """Why these inputs cannot be recorded (the runner then stays uncaptured), or None."""
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            continue
        if reads_in_place(i, a, static_idxs, stable):
            continue
        if i in mutated:
            return f"{mutated[i]} writes into input {i}, which is not a parameter or buffer"
        if not dense(a):
            return f"input {i} is not dense (strides {tuple(a.stride())}): cannot keep a static copy"
    return None


def plan_inputs(args: list[Any], static_idxs: frozenset[int], stable: set[int]) -> Plan:
    inputs: list[Any] = []
    copy_idxs, stable_idxs, param_idxs = [], [], set()
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            inputs.append(a)
            continue
        param = is_param(i, a, static_idxs)
        if param or a.data_ptr() in stable:
            inputs.append(a)
            stable_idxs.append(i)
            if param:
                param_idxs.add(i)
        else:
            buf = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
            buf.copy_(a)
            inputs.append(buf)
            copy_idxs.append(i)
    copy = set(copy_idxs)
    return Plan(
        inputs=inputs,
        buffers=[a if i in copy else None for i, a in enumerate(inputs)],
        copy_idxs=copy_idxs,
        stable_idxs=stable_idxs,
        stable_ptrs=[inputs[i].data_ptr() for i in stable_idxs],
        param_idxs=frozenset(param_idxs),
        input_ptrs={a.untyped_storage().data_ptr() for a in inputs if isinstance(a, torch.Tensor)},
        copy_ptrs={inputs[i].untyped_storage().data_ptr() for i in copy_idxs},
    )


def let_go(rec: Recording, idxs: Sequence[int]) -> dict[int, tuple]:
    """Drop ``rec``'s outputs at ``idxs`` so that a capture may reuse their memory."""
    saved = {}
    for i in idxs:
        t = rec.outputs[i]
        s = t.untyped_storage()
        saved[i] = (s.data_ptr(), s.nbytes(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        rec.outputs[i] = None
    rec.held_use, rec.held_storage = [], []  # their storages may be freed: no stale addresses
    if saved.keys() & set(rec.clone_idxs):
        rec.returned_storage = []
    return saved


def alias(rec: Recording, saved: dict[int, tuple]) -> None:
    """The outputs :func:`let_go` took, as views of the memory their graph's pool keeps."""
    storages: dict[int, torch.UntypedStorage] = {}
    for i, (ptr, nbytes, offset, size, stride, dtype, device) in saved.items():
        if ptr not in storages:
            storages[ptr] = st.storage_at(ptr, nbytes, device)
        rec.outputs[i] = st.tensor_at(storages[ptr], offset, size, stride, dtype)
    storages.clear()
    rec.count_held()
    if saved.keys() & set(rec.clone_idxs):
        rec.count_returned()


RELEASED = (
    "bucketwise: this tensor was returned by a CUDA-graph replay without a copy, and the recording "
    "whose memory it lives in was released (the model dropped or recompiled, a parameter moved, or "
    "the process group destroyed); keep a .clone() of an output needed after that"
)


def poison_held(poison: Any, outputs: list[tuple[torch.Tensor, int]]) -> None:
    """``poison`` (``CudaGraphs.poison``) every output still in use: (tensor, its storage's use
    count when only the recording held it). For a recording being dropped whose outputs live in
    memory its pool owns."""
    for t, use in outputs:
        if st.storage_use_count(st.storage_cdata(t)) > use:
            poison(t, RELEASED)


def signature(args: Sequence[Any]) -> tuple:
    """What a recording depends on besides addresses: shapes, strides, dtypes, scalar values."""
    return tuple(
        (a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a) for a in args
    )


def dense(t: torch.Tensor) -> bool:
    """``t``'s elements fill its memory once (permuted contiguous, not expanded or sliced): then
    an ``empty_strided`` buffer with its strides holds a copy of it."""
    if t.is_contiguous() or t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((std, s) for s, std in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True
