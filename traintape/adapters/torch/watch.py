"""``traintape.torch.watch``: hooks that record a torch model's training into a Recorder.

Step semantics (docs/store-format.md): step ``t`` counts completed optimizer steps from ``start_step``.
``param`` at step t is θ_t, the values *before* batch t's forward pass (the values the
gradient of step t is computed with); ``update`` = θ_{t+1} − θ_t; ``opt_state`` is the
optimizer state *after* step t. The *step boundary* of step t is the end of step t − 1
(or the ``watch`` call for the first step).

With an optimizer, the step boundary is the optimizer's step post-hook:

- at the boundary (post-hook of step t − 1, or ``watch`` itself): ``param`` stats and
  snapshots of *buffers* (BatchNorm ``running_mean``/``running_var``, which batch t's
  forward pass changes in place) and the activation probe (θ_t, before batch t);
- end of each backward pass (an autograd engine callback, after DDP's/FSDP2's
  reduction; :mod:`~traintape.adapters.torch.clip`): raw statistics of ``p.grad`` —
  the last backward of the step leaves the gradient accumulated over its micro-batches;
- step pre-hook (trainable/frozen parameters are still θ_t — a forward pass does not
  change them): ``param`` of the parameters; ``grad`` = the gradient as the backward
  pass produced it, *before* clipping (the end-of-backward statistics; if the gradients
  were rescaled since — ``clip_grad_norm_``, AMP unscaling — the factor is measured and
  the clip factor logged as the metric ``grad/clip_factor``); θ_t is copied (one
  batched ``torch._foreach_copy_``) if ``update`` is recorded;
- step post-hook: ``update`` = θ_{t+1} − θ_t as applied (in the parameter's dtype: 0
  where the optimizer's change was below half an ulp of θ), ``opt_state`` (see below), then one
  device→host transfer of every raw row of the step and one ``Recorder.record_step``;
  the step counter advances and the boundary reads of step t + 1 are taken.

With a closure (``opt.step(closure)``: LBFGS, Lightning), the pre-hook still reads θ_t
but the closure computes the gradient, so the closure is wrapped: ``grad`` is read right
after its **first** evaluation — ∇L(θ_t) on batch t, the gradient an SGD/Adam step applies
— and the step's activations are those of that first forward pass. Later evaluations in
the same step (LBFGS line search and inner iterations, at other points θ) are not
recorded. ``micro_batches`` counts every backward pass of the step.

Wrapper optimizers (Accelerate's ``AcceleratedOptimizer``, Lightning's
``LightningOptimizer``) are unwrapped to the ``torch.optim.Optimizer`` they delegate to
(:func:`unwrap_optimizer`): its hooks fire once per real step, after AMP unscaling.

Without an optimizer, call :meth:`WatchHandle.step` once per step *after* the parameter
update and *before* gradients are zeroed: it records ``grad`` (current ``p.grad``),
``update`` (θ now − θ at the previous boundary) and ``param`` θ_t (everything taken at
the previous boundary, or when ``watch`` was called for the first step).

Kinds: the policy's, or ``kinds=(...)``: exactly those, each recorded even when the
policy leaves it out (the explicit request wins, :mod:`traintape.adapters.kinds`).

Optimizer state (kind ``opt_state``, when the policy (or ``kinds``) records it and an
optimizer is given): every parameter-shaped tensor in ``optimizer.state[p]`` after step t, under
``<parameter canonical name>/<field>`` with the parameter's row block and permutation.
Fields use optax's state names so stores agree with the JAX adapter (see
:data:`~traintape.adapters.torch.opt_state.OPTAX_FIELDS`: Adam ``exp_avg``/``exp_avg_sq`` → ``mu``/``nu``, SGD
``momentum_buffer`` → ``trace``, ...); other optimizers keep torch's key. The set is
fixed at the first captured step with any state; a parameter with no state yet is
recorded as zeros (optax's initial state).

Gradient hooks (``register_post_accumulate_grad_hook``) fire once per parameter per
backward pass; they count backward passes and trigger the batched reduction of the
activations stashed by the forward hooks of that micro-batch. A trainable parameter that
got no gradient at a step is recorded as an all-zero gradient.

Activations: forward hooks on every parametrised module stash the (detached) output;
their stats are reduced in one batched call per micro-batch and merged over the
micro-batches of the step (stats over the whole batch). Forward passes run with grad
disabled (evaluation) are ignored. They are declared to the recorder in the order the
forward hooks first fired (the recorder derives ``manifest.forward_order`` from
it). Full snapshots of activations are taken only for a fixed ``probe`` input on
full-capture steps, at the step boundary: the model is run on it in ``eval()`` mode
under ``torch.no_grad()`` with θ_t (no RNG use, no BatchNorm update), and the outputs
are stored channels-last.

``torch.compile``: the forward hooks only stash outputs, so dynamo traces them without a
graph break (tested with ``fullgraph=True``, CPU); all statistics run eagerly in the
gradient and optimizer hooks, outside compiled graphs. Watch the model *before* calling
``torch.compile``: dynamo does not guard on module hooks, so code compiled before the
hooks existed would silently skip them. ``watch`` therefore refuses a compiled wrapper
(``OptimizedModule``). After :meth:`WatchHandle.remove`, graphs compiled while watching
still call the (now inert) hook closures until recompiled; they record nothing.

Steps not captured by the policy cost a flag test per hooked module call and per
gradient hook; nothing is computed or transferred.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from traintape.adapters.kinds import request_kinds
from traintape.adapters.start import start_step as first_step
from traintape.adapters.torch import clip as C
from traintape.adapters.torch import stats as S
from traintape.adapters.torch.dist import (
    counts_here,
    full,
    is_dtensor,
    local,
    shard_start,
    snapshot_part,
)
from traintape.adapters.torch.host import (
    canonical_host_copy,
    canonical_reader,
    host_copy,
    numpy_dtype_name,
)
from traintape.adapters.torch.names import (
    ActivationSite,
    ModelLayout,
    ParamEntry,
    activation_permutation,
    activation_tensor,
    model_layout,
)
from traintape.adapters.torch.opt_state import OptStateTracker
from traintape.core.group import merge_over
from traintape.core.naming import NameMap
from traintape.core.recorder import KindRows, Recorder
from traintape.core.writer import Part
from traintape.schema import Kind, TensorSpec
from traintape.schema.stats import IndexMap, index_map, merge

ADAPTER = "traintape.torch"


def _index_map(
    e: ParamEntry, held: tuple[int, ...], start: tuple[int, ...] | None = None
) -> IndexMap | None:
    """The :class:`~traintape.schema.stats.IndexMap` of the part ``held`` (its shape)
    of ``e``'s source tensor starting at source index ``start`` (None: all of it); the
    identity for a tensor whose rank is not ``e``'s (a scalar optimizer state)."""
    if len(held) != len(e.source_shape) or (start is None and held != tuple(e.source_shape)):
        return None
    return index_map(e.source_shape, e.permutation, start=start)


def _spec(e: ParamEntry, kind: Kind) -> TensorSpec:
    return TensorSpec.build(
        e.name,
        kind,
        layer_kind=e.layer_kind,
        dtype=numpy_dtype_name(e.tensor().dtype),
        shape=e.shape,
        source_name=e.source_name,
        source_shape=e.source_shape,
        permutation=e.permutation,
        aliases=e.aliases,
    )


class WatchHandle:
    """Hooks recording a torch model; use as a context manager or call :meth:`remove`.

    Created by :func:`watch` (an alias of this class), whose arguments are:

    Args:
        model: the torch module (not a ``torch.compile`` wrapper: watch, then compile).
        recorder: the :class:`traintape.Recorder`; its policy decides steps and kinds.
        optimizer: a ``torch.optim.Optimizer`` (or a wrapper around one, see
            :func:`unwrap_optimizer`); its ``step()`` hooks mark step boundaries (``param`` θ_t and ``grad``
            before, ``update`` θ_{t+1} − θ_t and ``opt_state`` after; buffers and the
            probe are read at the end of the previous step). Without one, call
            ``handle.step()`` after each update.
        name_map: mapping/callable renaming canonical names (see
            :mod:`traintape.core.naming`).
        start_step: optimizer step of the first recorded row; None (default): the
            recorder's :attr:`~traintape.Recorder.next_step` (``N`` after
            ``Recorder(url, resume_step=N)``). One that disagrees with a recorder
            continuing a run is a ``RecordError`` naming both steps.
        kinds: the kinds to record (among ``param``, ``grad``, ``update``,
            ``activation``, ``opt_state``); None (default): the policy's. Named kinds
            are recorded even when the policy leaves them out.
        activations: record outputs of parametrised modules (``<layer>/output``).
        probe: a fixed input (tensor or tuple of positional args) whose activations are
            stored in full on full-capture steps (eval mode, no grad, θ_t).
        frozen: when the ``param`` of frozen parameters (``requires_grad=False``, e.g. the
            base weights under LoRA) is read: ``"full"`` (default) at the first recorded
            step and on full-capture steps only — they do not change, and a large frozen
            base model is not read every step; their ``param`` rows are NaN ("not
            recorded") at other steps — or ``"every"`` captured step. Buffers (BatchNorm
            running statistics) change and are read every captured step either way.

    Attributes:
        step_index: the optimizer step the next recorded data belongs to.
        layout: canonical names/layouts of the model's tensors.
        micro_batches: backward passes seen during the current step.
        clipping: log ``grad/clip_factor`` at every captured step (1.0 when the
            gradients were not rescaled), not only from the first step a rescale is
            seen (the HF/Lightning callbacks set it when their trainer clips).
    """

    def __init__(
        self,
        model: nn.Module,
        recorder: Recorder,
        optimizer: Any = None,
        *,
        name_map: NameMap = None,
        start_step: int | None = None,
        activations: bool = True,
        probe: torch.Tensor | Sequence[Any] | None = None,
        frozen: str = "full",
        kinds: Sequence[Kind | str] | None = None,
    ) -> None:
        if frozen not in ("full", "every"):
            raise ValueError(f"traintape.torch.watch: frozen={frozen!r}; use 'full' or 'every'")
        self.frozen = frozen
        self._frozen_seen = False  # a frozen parameter's param was recorded once already
        self._absent: set[str] = set()  # param rows not recorded at the current step
        self.model = model
        self.rec = recorder
        self.optimizer = None if optimizer is None else unwrap_optimizer(optimizer)
        optimizer = self.optimizer
        self._kinds = None if kinds is None else frozenset(Kind(k) for k in kinds)
        if self._kinds is not None:
            request_kinds(recorder, self._kinds)  # asked for by name: whatever the policy
        self.step_index = first_step(recorder, start_step, "traintape.torch.watch")
        self.clipping = False
        self._clip_seen = False  # a rescale between backward and step was seen
        self._clip_warned = False
        self._grad_on = False  # grad recorded at the current step
        self._bwd: tuple[torch.Tensor, list[bool], Any] | None = None
        self._clip_check: Any = None  # (norm pairs, loss scale), then [factor]
        self._bwd_queued = False
        self._bwd_failed = False
        self._rank = recorder.group.index
        self.probe = probe
        self.micro_batches = 0
        self._removed = False
        self._handles: list[Any] = []
        self._removed = False
        if hasattr(model, "_orig_mod"):
            raise TypeError(
                "traintape.torch.watch: got a torch.compile'd module; hooks added after "
                "compilation are not seen by already-compiled code (dynamo does not guard on "
                "module hooks). Call watch(model, ...) on the plain module first, then "
                "torch.compile(model)."
            )
        _refuse_fsdp1(model)
        self.layout: ModelLayout = model_layout(model, name_map)
        pol = recorder.policy
        self.param_entries = [e for e in self.layout.entries if pol.selects(e.name)]
        self.train_entries = [e for e in self.param_entries if e.trainable]
        # θ_t of buffers (changed in place by the forward pass) is read at the step
        # boundary; with an optimizer, parameters are read in its step pre-hook
        if optimizer is None:
            self._boundary_params, self._pre_step_params = self.param_entries, []
        else:
            self._boundary_params = [e for e in self.param_entries if e.is_buffer]
            self._pre_step_params = [e for e in self.param_entries if not e.is_buffer]
        self.sites: list[ActivationSite] = (
            [s for s in self.layout.activations if pol.selects(s.name)] if activations else []
        )
        recorder.set_producer(
            framework="torch",
            framework_version=torch.__version__,
            adapter=ADAPTER,
            stats_backend=S.stats_backend(next((p.device for p in model.parameters()), None)),
        )
        self._declare_params()
        self._grads_taken = False
        # per-step device state: raw stat blocks per kind (merged at the step's end)
        self._pending: dict[Kind, list[tuple[list[str], torch.Tensor, list[bool]]]] = {}
        # per kind: host copies (activations; multi-process blocks) or a SnapshotStream
        self._snaps: dict[Kind, Any] = {}
        self._theta: list[torch.Tensor] | None = None
        self._act_raw: dict[str, torch.Tensor] = {}
        self._act_stash: list[tuple[ActivationSite, torch.Tensor]] = []
        self._act_shapes: dict[str, tuple[ActivationSite, nn.Module, torch.Tensor]] = {}
        self._act_on = False
        self._act_frozen = False
        self._probing = False
        self._closure_calls = 0  # closure evaluations of the current opt.step(closure)
        self._grads_taken = False
        self._act_declared: list[str] | None = None
        self._act_warned: set[str] = set()
        self._opt_state_tracker = (
            OptStateTracker(optimizer, self.train_entries)
            if optimizer is not None and self.train_entries
            else None
        )
        self._install()
        self._boundary()

    # ---------------------------------------------------------------- setup
    def _declare_params(self) -> None:
        specs: list[TensorSpec] = []
        if self._records(Kind.PARAM):
            specs += [_spec(e, Kind.PARAM) for e in self.param_entries]
        for kind in (Kind.GRAD, Kind.UPDATE):
            if self._records(kind):
                specs += [_spec(e, kind) for e in self.train_entries]
        if specs:
            self.rec.declare(specs)

    def _records(self, kind: Kind) -> bool:
        """Whether this watch records ``kind`` at all (the policy's, or ``kinds``)."""
        return (self._kinds is None or kind in self._kinds) and self.rec.policy.records_kind(kind)

    def _wants(self, step: int, kind: Kind) -> bool:
        """Whether ``kind`` is recorded at ``step`` (:meth:`Recorder.wants` and ``kinds``)."""
        return (self._kinds is None or kind in self._kinds) and self.rec.wants(step, kind)

    def _install(self) -> None:
        self._first_param = self.train_entries[0].tensor() if self.train_entries else None
        for e in self.train_entries:
            if e.rows is None or e.rows[0] == 0:
                self._handles.append(e.tensor().register_post_accumulate_grad_hook(self._on_grad))
        for site in self.sites:
            self._handles.append(site.module.register_forward_hook(self._forward_hook(site)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._on_pre_step))
            self._handles.append(self.optimizer.register_step_post_hook(self._on_post_step))

    def remove(self) -> None:
        """Remove every hook this handle added and drop pending data (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending.clear()
        self._snaps.clear()
        self._act_raw.clear()
        self._act_stash.clear()
        self._theta = None
        self._removed = True
        self._act_on = False

    def __enter__(self) -> WatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ---------------------------------------------------------------- hooks
    def _on_grad(self, p: torch.Tensor) -> None:
        if self._act_stash:
            self._reduce_activations()
        if p is self._first_param:
            self.micro_batches += 1
        if self._grad_on and not self._bwd_queued and not self._grads_taken:
            self._bwd_queued = True
            C.queue_end_of_backward(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Raw stats of the gradients as this backward pass left them (reduced over
        processes: DDP/FSDP2 finalise before this runs); the step's last one is
        recorded as ``grad``. A failure falls back to reading ``p.grad`` at the step."""
        self._bwd_queued = False
        if self._removed or self._grads_taken or not self._grad_on:
            return
        try:
            tensors = [(e, e.tensor().grad) for e in self.train_entries]
            shards = [self._shard(e, g) for e, g in tensors]
            raw = S.raw_stats([x for x, _, _ in shards], [m for _, _, m in shards])
            self._bwd = (raw, [h for _, h, _ in shards], C.versions(self._unique_train_tensors()))
        except Exception as e:  # capture must not fail the backward pass
            self._bwd = None
            if not self._bwd_failed:
                self._bwd_failed = True
                warnings.warn(
                    f"traintape.torch: gradient statistics at the end of backward failed "
                    f"({e!r}); grad is read at the optimizer step instead (after clipping)",
                    RuntimeWarning,
                    stacklevel=1,
                )

    def _forward_hook(self, site: ActivationSite) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            if not self._act_on or self._removed or self._act_frozen:
                return
            t = activation_tensor(out)
            if t is None:
                return
            if self._probing:
                perm = activation_permutation(mod, t)
                c = t.detach() if perm is None else t.detach().permute(perm)
                self._snaps.setdefault(Kind.ACTIVATION, {})[site.name] = host_copy(c)
                self._act_shapes.setdefault(site.name, (site, mod, t))
                return
            if not torch.is_grad_enabled():
                return  # evaluation passes between steps are not training activations
            self._act_shapes.setdefault(site.name, (site, mod, t))
            self._act_stash.append((site, t.detach()))

        return hook

    def _on_pre_step(self, opt: Any, args: Any, kwargs: Any) -> Any:
        """Before the update: parameters are θ_t. Without a closure ``p.grad`` is step t's
        gradient now; with one (``opt.step(closure)``) the closure computes it, so it is
        wrapped and the gradient is read right after its first evaluation."""
        self._params(self._pre_step_params)
        self._copy_theta()
        self._closure_calls = 0
        self._grads_taken = False
        # args are step()'s positional arguments, the optimizer itself first
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._grads()
            self._grads_taken = True
            return None
        wrapped = self._wrap_closure(closure)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    def _wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` that records ∇L(θ_t) after its first evaluation (forward +
        backward on batch t at θ_t) and stops activation capture for the step's later
        evaluations (LBFGS line search / inner iterations at other points)."""

        def wrapped() -> Any:
            out = closure()
            self._closure_calls += 1
            if self._closure_calls == 1:
                if self._act_stash:
                    self._reduce_activations()
                self._act_frozen = True
                self._grads()
                self._grads_taken = True
            return out

        return wrapped

    def _on_post_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        """After the update (θ_{t+1}): updates, optimizer state, record; next boundary."""
        if not self._grads_taken:  # a closure the optimizer never called: p.grad as is
            self._grads()
        self._opt_state()
        self._end()

    def step(self) -> None:
        """Mark the end of optimizer step ``step_index`` (only when no optimizer is given).

        Call after the parameter update and before the gradients are zeroed. Records step
        t (``grad`` = current ``p.grad``, ``update`` = θ now − θ at the previous boundary,
        ``param`` θ_t as read there) and takes θ_{t+1} for the next step.
        """
        if self.optimizer is not None:
            raise RuntimeError(
                "traintape.torch: handle.step() is for models watched without an optimizer; "
                "with optimizer=..., steps are marked by optimizer.step() hooks"
            )
        if self._removed:
            raise RuntimeError("traintape.torch: this watch handle was removed")
        self._grads()
        self._end()

    # ---------------------------------------------------------------- step logic
    def _add(
        self, kind: Kind, names: list[str], raw: torch.Tensor, here: list[bool] | None = None
    ) -> None:
        """Stash raw rows of ``names``; ``here``: whether each row enters the merge over
        processes from this one (default: every row — its part of the global batch)."""
        self._pending.setdefault(kind, []).append((names, raw, here or [True] * len(names)))

    def _add_tensors(
        self, kind: Kind, names: list[str], tensors: list[tuple[ParamEntry, torch.Tensor | None]]
    ) -> None:
        """Raw rows of ``tensors`` (entry, its tensor in source layout; None: no gradient
        or state yet) under ``names``: what this process holds of each
        (:meth:`_shard`), stashed with whether it counts in the merge over processes."""
        shards = [self._shard(e, t) for e, t in tensors]
        raw = S.raw_stats([x for x, _, _ in shards], [m for _, _, m in shards])
        self._add(kind, names, raw, [h for _, h, _ in shards])

    def _take_snapshots(
        self,
        kind: Kind,
        items: list[tuple[str, ParamEntry, torch.Tensor | None, torch.dtype]],
    ) -> None:
        """Snapshots of ``items`` (name, entry, tensor in source layout, dtype) on a
        full-capture step, taken now (the values change after this hook).

        One process: each tensor is *streamed* to the writer (:meth:`Recorder.stream_snapshot`)
        — copied to the host a piece at a time, each piece handed over at once, waiting
        while the writer holds its byte budget — so a full snapshot needs a bounded amount
        of host memory, not the model's size. A multi-process job hands each process's
        blocks over whole at the end of the step (:meth:`_snapshot`)."""
        t = self.step_index
        if self.rec.group.count > 1:
            if self.rec.snapshots(t, kind):
                snaps = self._snaps.setdefault(kind, {})
                snaps.update({n: self._snapshot(e, v, dt) for n, e, v, dt in items})
            return
        if kind not in self._snaps:  # one decision per step and kind (buffers, then params)
            self._snaps[kind] = self.rec.stream_snapshot(t, kind)
        stream = self._snaps[kind]
        if stream is None:
            return
        for n, e, v, dt in items:
            shape, dtype, read = canonical_reader(e, _part(e, full(v)), dt)
            stream.put(n, shape, dtype, read)

    def _snapshot(self, e: ParamEntry, t: torch.Tensor | None, dtype: torch.dtype) -> Any:
        """Host copy of ``t`` (``e``'s tensor, source layout) for a snapshot, canonical
        layout: this process's block (:func:`~traintape.adapters.torch.dist.snapshot_part`)
        of a sharded tensor in a multi-process job — every process writes the blocks it
        holds — else the whole tensor (a sharded one assembled with ``full_tensor()``),
        which process 0 alone writes: the others make no host copy of it."""
        multi = self.rec.group.count > 1
        if multi and t is not None and e.rows is None:
            part = snapshot_part(t, e.permutation, self._rank)
            if part is not None:
                return part
        whole = _part(e, full(t))  # a collective for a sharded tensor: every process joins
        if multi and self._rank != 0:
            shape = tuple(e.shape)
            return Part(None, (0,) * len(shape), shape, shape, numpy_dtype_name(dtype))
        return canonical_host_copy(e, whole, dtype)

    def _shard(
        self, e: ParamEntry, t: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, bool, IndexMap | None]:
        """What this process reduces of ``t`` (``e``'s tensor, source layout), whether
        it counts in the merge over processes (:func:`~traintape.adapters.torch.dist.counts_here`)
        and where its elements sit in the canonical tensor (the ``sig`` statistic's
        :class:`~traintape.schema.stats.IndexMap`: ``e``'s permutation, and the offset
        of a local shard). A row block of a sharded tensor, or a tensor sharded other
        than in plain blocks, is cut from the whole one (a collective)."""
        start = shard_start(t)
        if t is not None and is_dtensor(t) and (e.rows is not None or start is None):
            return e.part(full(t)), self._rank == 0, _index_map(e, e.source_shape)
        x = local(t)
        if x is None:
            return None, counts_here(t, self._rank), None
        x = e.part(x)
        return x, counts_here(t, self._rank), _index_map(e, tuple(x.shape), start)

    def _boundary(self) -> None:
        """Start step ``step_index`` before its first forward pass: reset the per-step
        state and read what batch t's forward could change (buffers, probe), plus every
        ``param`` and the θ_t copy when there is no optimizer."""
        t, rec = self.step_index, self.rec
        self._grad_on = bool(self.train_entries) and self._wants(t, Kind.GRAD)
        self._grads_taken = False
        self._bwd = None
        self._act_on = bool(self.sites) and self._wants(t, Kind.ACTIVATION)
        self._act_frozen = False
        self._act_shapes = {}
        self.micro_batches = 0
        self._params(self._boundary_params)
        if self.optimizer is None:
            self._copy_theta()
        if self.probe is not None and self._act_on and rec.snapshots(t, Kind.ACTIVATION):
            self._run_probe()

    def _params(self, entries: list[ParamEntry]) -> None:
        """``param`` stats (and snapshots on full steps) of ``entries``, read now."""
        t, rec = self.step_index, self.rec
        if not entries or not self._wants(t, Kind.PARAM):
            return
        frozen = [e for e in entries if not e.is_buffer and not e.trainable]
        if frozen and self.frozen == "full":
            if self._frozen_seen and not rec.policy.is_full(t):
                skip = {e.name for e in frozen}  # unchanged since read: rows stay NaN
                self._absent |= skip
                self._add(Kind.PARAM, sorted(skip), S.empty_raw(len(skip)))
                entries = [e for e in entries if e.name not in skip]
            self._frozen_seen = True
        if not entries:
            return
        self._add_tensors(Kind.PARAM, [e.name for e in entries],
                          [(e, e.tensor().detach()) for e in entries])  # fmt: skip
        self._take_snapshots(
            Kind.PARAM, [(e.name, e, e.tensor().detach(), e.tensor().dtype) for e in entries]
        )

    def _copy_theta(self) -> None:
        """Copy θ_t of the trainable parameters (for ``update``), or drop the copy."""
        if not self.train_entries or not self._wants(self.step_index, Kind.UPDATE):
            self._theta = None
            return
        live = [local(p.detach()) for p in self._unique_train_tensors()]
        with torch.no_grad():
            if self._theta is None or len(self._theta) != len(live):
                self._theta = [torch.empty_like(p) for p in live]
            torch._foreach_copy_(self._theta, live)

    def _unique_train_tensors(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for e in self.train_entries:
            p = e.tensor()
            seen.setdefault(id(p), p)
        return list(seen.values())

    def _run_probe(self) -> None:
        modes = {m: m.training for m in self.model.modules()}
        self._probing = True
        try:
            self.model.eval()
            with torch.no_grad():
                probe = self.probe
                if isinstance(probe, (tuple, list)):
                    self.model(*probe)
                else:
                    self.model(probe)
        finally:
            self._probing = False
            for m, mode in modes.items():
                m.training = mode

    def _grads(self) -> None:
        """``grad`` of step t: the end-of-backward statistics (pre-clip; AMP's loss scale
        divided out), or ``p.grad`` read now when no backward pass was seen (gradients
        set by hand). The gradients' norms now against those at the end of backward give
        the clip factor (:mod:`.clip`), resolved with the step's one transfer in
        :meth:`_end` — here only on full-capture steps, whose snapshots need it."""
        t = self.step_index
        bwd, self._bwd = self._bwd, None
        self._clip_check = None
        if not self.train_entries or not self._wants(t, Kind.GRAD):
            return
        names = [e.name for e in self.train_entries]
        grads = [e.tensor().grad for e in self.train_entries]
        if bwd is None:
            self._add_tensors(Kind.GRAD, names, list(zip(self.train_entries, grads, strict=True)))
        else:
            raw, here, before = bwd
            full = self.rec.policy.snapshots(t, Kind.GRAD)
            if before is None or full or before != C.versions(self._unique_train_tensors()):
                amp = C.loss_scale()
                if amp != 1.0:
                    raw = C.scale_raw(raw, 1.0 / amp)
                now = [self._shard(e, g)[0] for e, g in zip(self.train_entries, grads, strict=True)]
                self._clip_check = (C.norm_pairs(bwd[0], now), amp)
            else:  # the same gradient tensors, never changed in place: not rescaled
                self._clip_check = [1.0]
            self._add(Kind.GRAD, names, raw, here)
            if full:
                factor = self._clip_factor()
                if factor not in (None, 1.0):
                    with torch.no_grad():  # the snapshot before clipping (within rounding)
                        grads = [None if g is None else g / factor for g in grads]
        self._take_snapshots(
            Kind.GRAD,
            [
                (e.name, e, g, e.tensor().dtype)
                for e, g in zip(self.train_entries, grads, strict=True)
            ],
        )

    def _clip_factor(self) -> float | None:
        """Resolve the step's clip factor (once; a device→host transfer of 2 × n norms)
        and remember it for the metric; None when the change was not one factor."""
        check = self._clip_check
        if check is None:
            return 1.0
        if isinstance(check, tuple):
            pairs, amp = check
            host = None if pairs is None else pairs.cpu().numpy()
            factor = C.clip_factor(host, amp)
            self._clip_check = [factor]  # resolved
            if factor is None:
                self._warn_not_uniform(self.step_index)
            elif factor != 1.0:
                self._clip_seen = True
            return factor
        return check[0]

    def _warn_not_uniform(self, t: int) -> None:
        if self._clip_warned:
            return
        self._clip_warned = True
        warnings.warn(
            f"traintape.torch: at step {t} the gradients were changed between the end of "
            f"backward and optimizer.step() by something other than one common factor "
            f"(not clip_grad_norm_: e.g. clip_grad_value_ or edited gradients); grad stats "
            f"are the gradient as backward produced it, no grad/clip_factor is logged",
            RuntimeWarning,
            stacklevel=3,
        )

    def _updates(self) -> None:
        t = self.step_index
        if self._theta is None or not self._wants(t, Kind.UPDATE):
            return
        live = self._unique_train_tensors()
        with torch.no_grad():
            diff = torch._foreach_sub([local(p.detach()) for p in live], self._theta)
        # a sharded parameter's difference is a shard too: the same placements
        by_id = {id(p): _like(p, d) for p, d in zip(live, diff, strict=True)}
        self._add_tensors(Kind.UPDATE, [e.name for e in self.train_entries],
                          [(e, by_id[id(e.tensor())]) for e in self.train_entries])  # fmt: skip
        self._take_snapshots(
            Kind.UPDATE,
            [(e.name, e, by_id[id(e.tensor())], e.tensor().dtype) for e in self.train_entries],
        )

    def _opt_state(self) -> None:
        """``opt_state`` after step t: parameter-shaped ``optimizer.state`` tensors."""
        t, opt = self.step_index, self._opt_state_tracker
        if opt is None or not self._wants(t, Kind.OPT_STATE):
            return
        leaves = opt.leaves(self.rec)
        if not leaves:
            return
        wholes = [leaf.whole(opt.optimizer) for leaf in leaves]
        self._add_tensors(Kind.OPT_STATE, [leaf.name for leaf in leaves],
                          [(leaf.entry, v) for leaf, v in zip(leaves, wholes, strict=True)])  # fmt: skip
        self._take_snapshots(
            Kind.OPT_STATE,
            [
                (leaf.name, leaf.entry, v, leaf.dtype)
                for leaf, v in zip(leaves, wholes, strict=True)
            ],
        )

    def _reduce_activations(self) -> None:
        stash, self._act_stash = self._act_stash, []
        # the batch axis is free: the sig pattern runs over the per-example canonical
        # index, so micro-batches and data-parallel parts merge exactly
        maps = [
            index_map(t.shape, activation_permutation(site.module, t), batch=True)
            if t.ndim
            else None
            for site, t in stash
        ]
        raw = S.raw_stats([t for _, t in stash], maps)
        for i, (site, _) in enumerate(stash):
            row = raw[i : i + 1]
            prev = self._act_raw.get(site.name)
            self._act_raw[site.name] = row if prev is None else merge(prev, row, torch)

    def _declare_activations(self) -> None:
        """Declare the activations seen this step, in the order their forward hooks
        first fired (the recorder keeps it as ``forward_order``)."""
        specs = []
        for name, (site, mod, out) in self._act_shapes.items():
            perm = activation_permutation(mod, out)
            src = list(out.shape)
            specs.append(
                TensorSpec.build(
                    name,
                    Kind.ACTIVATION,
                    layer_kind=site.layer_kind,
                    dtype=numpy_dtype_name(out.dtype),
                    shape=src if perm is None else [src[i] for i in perm],
                    source_name=f"{site.source_name}:output",
                    source_shape=src,
                    permutation=perm,
                )
            )
        self.rec.declare(specs)
        self._act_declared = list(self._act_shapes)

    def _activations(self) -> None:
        if not self._act_on:
            return
        if self._act_stash:
            self._reduce_activations()
        if not self._act_raw:
            return
        if self._act_declared is None:
            self._declare_activations()
        names = self._act_declared or []
        for extra in set(self._act_raw) - set(names):
            if extra not in self._act_warned:
                self._act_warned.add(extra)
                warnings.warn(
                    f"traintape.torch: activation {extra!r} first appeared after the "
                    f"activation set was declared; it is not recorded",
                    stacklevel=2,
                )
        device = next(iter(self._act_raw.values())).device
        empty = S.empty_raw(1, device)
        rows = [self._act_raw.get(n, empty) for n in names]
        self._add(Kind.ACTIVATION, names, torch.cat(rows))
        snaps = self._snaps.get(Kind.ACTIVATION)
        if snaps is not None and set(snaps) != set(names):
            self._snaps.pop(Kind.ACTIVATION)

    def _end(self) -> None:
        """Finish step ``step_index``: updates, activations, one transfer, record; then
        the boundary of the next step."""
        self._updates()
        self._activations()
        pending, self._pending = self._pending, {}
        snaps, self._snaps = self._snaps, {}
        self._act_raw = {}
        t = self.step_index
        blocks = [(k, names, m, h) for k, parts in pending.items() for names, m, h in parts]
        if self._clip_check is not None:
            factor = self._clip_factor()
            self._clip_check = None
            if factor is not None and (self._clip_seen or self.clipping) and self._rank == 0:
                self.rec.log(t, {"grad/clip_factor": factor})
        if blocks:
            mats = [m for _, _, m, _ in blocks]
            if len({m.device for m in mats}) > 1:
                mats = [m.cpu() for m in mats]
            raw = S.to_host(torch.cat(mats) if len(mats) > 1 else mats[0])
            if self.rec.group.count > 1:  # exact global rows; every process calls it here
                raw = merge_over(self.rec.group, raw, np.concatenate([h for *_, h in blocks]))
            rows: dict[Kind, tuple[list[str], list[np.ndarray]]] = {}
            start = 0
            for (k, names, _, _), m in zip(blocks, mats, strict=True):
                kn, kv = rows.setdefault(k, ([], []))
                kn.extend(names)
                kv.append(raw[start : start + m.shape[0]])
                start += m.shape[0]
            absent, self._absent = self._absent, set()
            self.rec.record_step(
                t,
                [
                    KindRows(
                        k,
                        kn,
                        np.concatenate(kv),
                        snaps.get(k),
                        absent=[n for n in kn if n in absent] if k == Kind.PARAM else (),
                    )
                    for k, (kn, kv) in rows.items()
                ],
            )
        self.step_index = t + 1
        self._boundary()


def _refuse_fsdp1(model: nn.Module) -> None:
    """FSDP1 (``FullyShardedDataParallel``) flattens parameters into FlatParameters; the
    adapter records FSDP2 (``fully_shard``: DTensor parameters under their own names)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError(
            "traintape.torch.watch: FullyShardedDataParallel (FSDP1) is not supported — its "
            "flat parameters have no per-tensor names or layouts. Use FSDP2 "
            "(torch.distributed.fsdp.fully_shard), which traintape records with exact global "
            "statistics, or DistributedDataParallel."
        )


def _part(e: ParamEntry, t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else e.part(t)


def _like(p: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``d`` (this rank's part of a tensor shaped like ``p``) as a DTensor placed like
    ``p`` when ``p`` is one, else ``d``."""
    if not is_dtensor(p):
        return d
    from torch.distributed.tensor import DTensor

    dp: Any = p
    return DTensor.from_local(
        d, dp.device_mesh, dp.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def callback_watch_kwargs(owner: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``watch`` arguments given to a training-loop callback (HF Trainer, Lightning): the
    callback sets ``optimizer`` and ``start_step`` itself, so passing them is refused."""
    for k in ("optimizer", "start_step"):
        if k in kwargs:
            raise TypeError(f"{owner}: {k}= is set by the callback")
    return dict(kwargs)


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` inside ``optimizer``: itself, or the optimizer a
    wrapper delegates ``step()`` to (Accelerate's ``AcceleratedOptimizer.optimizer``,
    Lightning's ``LightningOptimizer._optimizer``, ...), followed through ``.optimizer``
    and ``._optimizer`` attributes. Its step hooks fire once per real optimizer step:
    after AMP unscaling, and not for a step a ``GradScaler`` skipped."""
    seen: set[int] = set()
    obj = optimizer
    while id(obj) not in seen:  # wrappers may subclass Optimizer (AcceleratedOptimizer)
        seen.add(id(obj))
        inner = next(
            (
                getattr(obj, a)
                for a in ("optimizer", "_optimizer")
                if getattr(obj, a, None) is not None and getattr(obj, a) is not obj
            ),
            None,
        )
        if inner is None:
            break
        obj = inner
    if not isinstance(obj, torch.optim.Optimizer) or not hasattr(obj, "_optimizer_step_pre_hooks"):
        raise TypeError(
            f"traintape.torch.watch: optimizer of type {type(optimizer).__qualname__} is not "
            f"a torch.optim.Optimizer and wraps none (looked for .optimizer/._optimizer); "
            f"pass the torch optimizer whose step() updates the parameters"
        )
    return obj


watch = WatchHandle
"""``watch(model, recorder, optimizer=None, *, name_map=None, start_step=0,
activations=True, probe=None) -> WatchHandle``: record ``model``'s params, grads,
updates, activations (and optimizer state) into ``recorder``; leaving the returned
handle (a context manager) removes every hook. Arguments: see :class:`WatchHandle`."""


__all__ = ["WatchHandle", "host_copy", "numpy_dtype_name", "watch"]
