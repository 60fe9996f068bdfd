"""ZeroRedundancyOptimizer: ZeRO stage 1, with the constructor and methods of torch's.

Every rank sees all parameters (``param_groups`` holds them all, so LR schedulers and user code
work as with any optimizer), but each rank's local optimizer, an ordinary ``optimizer_class``,
holds only the parameters this rank owns (see [Note: ZeRO partition] in partition.py) and so
only their state. ``step()`` updates the owned parameters locally, then every rank broadcasts
its updated parameters to the others as flat buffers (see collectives.py): one broadcast per
owner and dtype with ``parameters_as_bucket_view=True`` (parameters are views into persistent
per-owner buffers, nothing is copied), or per chunk of at most 4 MiB otherwise (temporary
buffers, at most four chunks in flight, so at most 16 MiB extra). With
``overlap_with_ddp=True`` the step runs inside DDP's backward instead, bucket by bucket (see
[Note: ZeRO step inside DDP's backward] in overlap.py).

``partition="elements"`` cuts the parameters into equal element ranges instead of giving each
rank whole ones (see [Note: ZeRO element partition] in elements.py): every rank then holds
``1 / world`` of the optimizer state whatever the parameters' shapes, and after a step one
all-gather per dtype (element_shards.py) replaces the owners' broadcasts. Only element-wise
optimizers (AdamW, Adam, SGD...: ``ELEMENT_WISE``) may be used so.

Checkpoints: ``consolidate_state_dict(to)`` gathers every rank's state on rank ``to``, keyed by
global parameter index exactly like a plain optimizer's state dict, so ``load_state_dict`` can
re-partition it at any world size (or load it into a plain optimizer).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from shardwise.distributed.collectives import group_by_dtype
from shardwise.dp.agree import check_same_parameters
from shardwise.dp.data_parallel import MIB
from shardwise.memory import heap
from shardwise.zero import collectives as zc
from shardwise.zero import state_dicts
from shardwise.zero.element_shards import ElementShards, merge_pieces
from shardwise.zero.elements import check_partition, is_element_wise
from shardwise.zero.join import ZeroJoinHook
from shardwise.zero.overlap import OverlapState
from shardwise.zero.partition import Weight, chunk_by_bytes, partition_params, rank_loads

CHUNK_BYTES = 4 * MIB
IN_PLACE_BYTES = MIB  # parameters at least this big are broadcast alone, in place
CHUNKS_IN_FLIGHT = 4
_MISSING = object()
# optimizers whose update of a parameter depends on that parameter's gradient and state alone,
# so that stepping the parameters part by part gives the same result as one step
PER_PARAMETER = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                 torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
                 torch.optim.Adadelta)


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wraps ``optimizer_class`` so that each rank of ``process_group`` (default: the world)
    keeps the optimizer state of its partition of the parameters only.

    ``params``: tensors or param-group dicts, as for any optimizer. ``**defaults`` go to
    ``optimizer_class`` (e.g. ``lr=1e-3``). ``parameters_as_bucket_view=True`` makes the
    parameters views into one flat buffer per owning rank and dtype, which are broadcast in
    place after each step. ``overlap_with_ddp=True``: ownership follows the buckets of the
    DistributedDataParallel model this optimizer is attached to with
    ``shardwise.zero.hook_with_zero_step`` (or ``..._interleaved``), which step it during
    backward; ``step()`` then does nothing (it warns once), and the optimizer cannot be used
    before it is attached (see overlap.py). ``partition``: ``"parameters"`` (default, torch's
    semantics: each parameter owned whole by one rank) or ``"elements"`` (equal element ranges,
    parameters may be split across ranks; element-wise optimizers only; not with
    ``parameters_as_bucket_view`` or ``overlap_with_ddp``).
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[Optimizer],
                 process_group: dist.ProcessGroup | None = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 partition: str = "parameters", **defaults: Any):
        _check_optimizer_class(optimizer_class)
        self.partition = check_partition(partition)
        if partition == "elements":
            _check_element_options(optimizer_class, parameters_as_bucket_view, overlap_with_ddp)
        self._elements: ElementShards | None = None
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ZeroRedundancyOptimizer needs an initialized process group: call "
                               "shardwise.distributed.init() (or init_process_group) first")
        self._initialized = False
        self._warned_step = False
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)
        params = [p for g in self.param_groups for p in g["params"]]
        _check_params(params)
        if params and params[0].device.type == "cpu":
            heap.keep_heap_resident()  # [Note: heap kept resident across steps]
        self.optimizer_class = optimizer_class
        self.process_group = process_group or dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        check_same_parameters(params, self.process_group, what="ZeroRedundancyOptimizer")
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.overlap_with_ddp = overlap_with_ddp
        self._overlap: OverlapState | None = None  # set when attached to a DDP model
        self._local_defaults = defaults
        self._buffers: list[tuple[int, torch.Tensor]] = []  # (owner, 1D flat) for bucket view
        self._consolidated: dict[str, Any] | None = None
        if overlap_with_ddp:
            self._defer_partition()
        elif partition == "elements":
            self._elements = ElementShards([g["params"] for g in self.param_groups],
                                           self.process_group)
            self._partition = [[[] for _ in self.param_groups] for _ in range(self.world_size)]
            self._make_local_optimizer()
        else:
            self._partition = partition_params(self._group_sizes(), self.world_size)
            self._make_local_optimizer()
        self._initialized = True
        self._build_buffers()

    def _make_local_optimizer(self) -> None:
        self.optim = self.optimizer_class(self._local_groups(), **self._local_defaults)
        self.state = self.optim.state  # type: ignore[assignment]  # this rank's part
        self._fill_missing_hyperparameters()

    # -- overlap_with_ddp --------------------------------------------------------------------

    def _defer_partition(self) -> None:
        """Before attachment nobody owns anything (the buckets decide, see overlap.py)."""
        if len(self.param_groups) != 1:
            raise ValueError("overlap_with_ddp=True supports a single parameter group, got "
                             f"{len(self.param_groups)}")
        self._partition = [[[]] for _ in range(self.world_size)]
        self.optim = None  # type: ignore[assignment]
        self.state = {}  # type: ignore[assignment]

    def _attach_overlap(self, overlap: OverlapState) -> None:
        """Take ownership from ``overlap``'s buckets and build the local optimizer over this
        rank's buckets (called by hook_with_zero_step)."""
        if self._overlap is not None:
            raise RuntimeError("this ZeroRedundancyOptimizer is already attached to a "
                               "DistributedDataParallel model")
        params = self.param_groups[0]["params"]
        index = {id(p): i for i, p in enumerate(params)}
        bucketed = [p for b in overlap.buckets for p in b.params]
        missing = [i for i, p in enumerate(params) if p.requires_grad and id(p) not in
                   {id(q) for q in bucketed}]
        foreign = [p for p in bucketed if id(p) not in index]
        if missing or foreign:
            raise ValueError(f"overlap_with_ddp: the optimizer's trainable parameters must be "
                             f"the DDP model's; {len(missing)} of the optimizer's are not in the "
                             f"model, {len(foreign)} of the model's not in the optimizer")
        self._partition = [[sorted(index[id(p)] for p in overlap.owned_params(r))]
                           for r in range(self.world_size)]
        if self._partition[self.rank][0]:
            self._make_local_optimizer()
        self._overlap = overlap

    def _check_attached(self, what: str) -> None:
        if self.overlap_with_ddp and self._overlap is None:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer(overlap_with_ddp=True).{what}: the optimizer is not "
                "attached to a DistributedDataParallel model, so no rank owns any parameter. "
                "Attach it: ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, "
                "ddp, optimizer)) (shardwise.zero), then train; the step runs in backward.")

    def _step_bucket(self, bucket: Any, reduced: torch.Tensor) -> None:
        """Step this rank's local optimizer on one bucket's parameters with its reduced
        gradients (views of ``reduced``); the other parameters and their ``.grad`` are left
        alone, and optimizer state is keyed by parameter, so one optimizer serves all buckets."""
        self._push_hyperparameters()  # a scheduler may have changed lr since the last bucket
        saved = [p.grad for p in bucket.params]
        for p, offset in zip(bucket.params, bucket.offsets):
            p.grad = reduced[offset : offset + p.numel()].view_as(p)
        groups = self.optim.param_groups
        self.optim.param_groups = [{**groups[0], "params": list(bucket.params)}]
        try:
            self.optim.step()
        finally:
            self.optim.param_groups = groups
            for p, grad in zip(bucket.params, saved):
                p.grad = grad

    # -- partition ---------------------------------------------------------------------------

    def _group_sizes(self) -> list[list[Weight]]:
        # (trainable bytes, frozen bytes): see [Note: ZeRO partition] for why both.
        return [[_weight(p) for p in g["params"]] for g in self.param_groups]

    def _local_groups(self) -> list[dict[str, Any]]:
        if self._elements is not None:
            return [{**_hyper(group), "params": views} for group, views in
                    zip(self.param_groups, self._elements.local_groups(), strict=True)]
        mine = self._partition[self.rank]
        return [{**_hyper(group), "params": [group["params"][i] for i in mine[g]]}
                for g, group in enumerate(self.param_groups)]

    def owner_of(self, param: torch.Tensor) -> int:
        """The rank whose local optimizer updates ``param``."""
        self._check_whole_owners("owner_of")
        for rank, per_rank in enumerate(self._partition):
            for g, indices in enumerate(per_rank):
                if any(self.param_groups[g]["params"][i] is param for i in indices):
                    return rank
        raise KeyError("this parameter is not in the optimizer's param_groups")

    def owners(self) -> dict[torch.Tensor, int]:
        """Every parameter -> the rank that owns it."""
        self._check_whole_owners("owners")
        return {self.param_groups[g]["params"][i]: rank
                for rank, per_rank in enumerate(self._partition)
                for g, indices in enumerate(per_rank) for i in indices}

    def _check_whole_owners(self, what: str) -> None:
        if self._elements is not None:
            raise RuntimeError(f"ZeroRedundancyOptimizer.{what}(): with partition='elements' a "
                               "parameter may be split across ranks, so it has no one owner")

    def owned_params(self, rank: int | None = None) -> list[torch.Tensor]:
        """The parameters ``rank`` (default: this rank) owns whole, in group order (none with
        ``partition="elements"``, where ranks hold element ranges)."""
        per_rank = self._partition[self.rank if rank is None else rank]
        return [self.param_groups[g]["params"][i] for g, idx in enumerate(per_rank) for i in idx]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (collectively: all ranks must add the same group). Its
        parameters are partitioned after the existing ones, which keep their owners."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group = {**param_group, "params": params}
        if self._initialized and self._elements is not None:
            raise RuntimeError("ZeroRedundancyOptimizer(partition='elements'): every param "
                               "group must be given to the constructor (a group added later "
                               "would move every rank's element range); add_param_group is "
                               "not available")
        if self._initialized:
            _check_params([p for g in self.param_groups for p in g["params"]] + params)
        super().add_param_group(param_group)
        if not self._initialized:
            return
        if self.overlap_with_ddp:
            raise RuntimeError("overlap_with_ddp=True supports a single parameter group; "
                               "add_param_group is not available")
        sizes = self._group_sizes()
        loads = rank_loads(self._partition, sizes[:-1])
        new = partition_params(sizes[-1:], self.world_size, loads)
        for rank in range(self.world_size):
            self._partition[rank].append(new[rank][0])
        group = self.param_groups[-1]
        self.optim.add_param_group(
            {**_hyper(group), "params": [group["params"][i] for i in new[self.rank][0]]})
        self._fill_missing_hyperparameters()
        self._build_buffers()

    # -- step --------------------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:
        """Step the local optimizer on this rank's parameters, then broadcast every rank's
        updated parameters (collective: all ranks call it). ``closure`` and ``**kwargs`` go to
        the local optimizer's ``step`` (without ``closure`` when none is given, as some
        optimizers' ``step`` takes none). Inside ``torch.distributed.algorithms.join.Join``, a
        rank that has run out of inputs issues the same collectives (see join.py)."""
        if self.overlap_with_ddp:
            self._check_attached("step()")
            if not self._warned_step:
                warnings.warn("ZeroRedundancyOptimizer(overlap_with_ddp=True).step() does "
                              "nothing: the step runs during DDP's backward; leave it out of "
                              "the training loop", stacklevel=2)
                self._warned_step = True
            return None
        Join.notify_join_context(self)
        return self._step_and_sync(closure, kwargs)

    def _step_and_sync(self, closure: Callable[[], float] | None, kwargs: dict[str, Any]
                       ) -> Any:
        self._push_hyperparameters()
        if self._elements is not None:
            return self._step_elements(closure, kwargs)
        if self._steps_by_part(closure, kwargs):
            zc.step_and_broadcast(self._parts(), self._step_part, self.process_group,
                                  CHUNKS_IN_FLIGHT)
            self._pull_hyperparameters()
            return None
        if closure is None:
            loss = self.optim.step(**kwargs)
        else:
            loss = self.optim.step(closure=closure, **kwargs)
        self._pull_hyperparameters()
        self._sync_params()
        return loss

    def _step_elements(self, closure: Callable[[], float] | None, kwargs: dict[str, Any]
                       ) -> Any:
        """The element partition's step: the local optimizer steps this rank's pieces (their
        gradients are slices of the parameters' full gradients, or stage 2's reduced parts),
        then one all-gather per dtype brings every rank's range to every rank. A closure runs
        first, here, so that the pieces see the gradients it computes."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        shards = self._elements
        shards.take_grads()
        try:
            self.optim.step(**kwargs)
        finally:
            shards.release_grads()
        self._pull_hyperparameters()
        shards.all_gather()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's ``.grad`` and, with the element partition, the gradients of
        this rank's pieces (stage 2 keeps the reduced gradients there)."""
        super().zero_grad(set_to_none=set_to_none)
        if self._elements is not None:
            self.optim.zero_grad(set_to_none=set_to_none)

    def _steps_by_part(self, closure: Any, kwargs: dict[str, Any]) -> bool:
        """Whether the step can go part by part, each part broadcast while the next is
        stepped: for the optimizers whose update of a parameter reads only that parameter's
        gradient and state (the per-parameter ones in ``PER_PARAMETER``), without a closure,
        when broadcasts are per part (not one flat buffer per owner)."""
        return (closure is None and not kwargs and self.world_size > 1
                and not self.parameters_as_bucket_view and self.optim is not None
                and type(self.optim) in PER_PARAMETER)

    def _parts(self) -> list[tuple[int, list[torch.Tensor]]]:
        """Every owner's trainable parameters in parts: one per parameter of at least
        ``IN_PLACE_BYTES`` (broadcast in place), the smaller ones in chunks; the owners' parts
        interleaved (part 0 of every rank, then part 1...) so that all ranks step together.
        Cached: the parameters change only with ``add_param_group``."""
        if self._parts_cache is None:
            per_rank = [self._owner_parts(rank) for rank in range(self.world_size)]
            longest = max(len(parts) for parts in per_rank)
            self._parts_cache = [(rank, parts[k]) for k in range(longest)
                                 for rank, parts in enumerate(per_rank) if k < len(parts)]
        return self._parts_cache

    def _owner_parts(self, rank: int) -> list[list[torch.Tensor]]:
        trained = [p for p in self.owned_params(rank) if p.requires_grad]
        parts: list[list[torch.Tensor]] = []
        for same in group_by_dtype(trained):
            big = [p for p in same if p.numel() * p.element_size() >= IN_PLACE_BYTES]
            small = [p for p in same if p.numel() * p.element_size() < IN_PLACE_BYTES]
            parts += [[p] for p in big]
            runs = chunk_by_bytes([p.numel() * p.element_size() for p in small], CHUNK_BYTES)
            parts += [[small[i] for i in run] for run in runs]
        return parts

    def _step_part(self, params: list[torch.Tensor]) -> None:
        """Step the local optimizer on ``params`` only: its groups are narrowed to them for
        the call (state is keyed by parameter, so it carries over). Which group each of them
        is in is looked up once and cached, so a step's work is per part, not per part and
        parameter."""
        groups = self.optim.param_groups
        layout = self._part_layouts.get(id(params))
        if layout is None:
            wanted = {id(p) for p in params}
            layout = [(g, [p for p in group["params"] if id(p) in wanted])
                      for g, group in enumerate(groups)]
            layout = self._part_layouts[id(params)] = [(g, ps) for g, ps in layout if ps]
        self.optim.param_groups = [{**groups[g], "params": ps} for g, ps in layout]
        try:
            self.optim.step()
        finally:
            self.optim.param_groups = groups

    # -- join (uneven inputs) ----------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook ``Join`` runs on a rank that has run out of inputs: it takes part in the
        collectives of the other ranks' ``step()``. ``Join`` hands every joinable the keyword
        arguments given to it, meant for any of them, so they are accepted and not used."""
        return ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """Where ``Join``'s own all-reduces run: the parameters' device."""
        return self.param_groups[0]["params"][0].device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The group this optimizer's collectives run on."""
        return self.process_group

    def _sync_params(self) -> None:
        if self.world_size == 1:
            return
        if self.parameters_as_bucket_view:
            zc.broadcast_buffers(self._buffers, self.process_group)
        else:
            zc.broadcast_chunks(self._chunks(), self.process_group, CHUNKS_IN_FLIGHT)

    def _chunks(self) -> list[tuple[int, list[torch.Tensor]]]:
        chunks = []
        for rank in range(self.world_size):
            trained = [p.detach() for p in self.owned_params(rank) if p.requires_grad]
            for same in group_by_dtype(trained):
                runs = chunk_by_bytes([t.numel() * t.element_size() for t in same], CHUNK_BYTES)
                chunks += [(rank, [same[i] for i in run]) for run in runs]
        return chunks

    def _build_buffers(self) -> None:
        """With ``parameters_as_bucket_view``: one flat buffer per owner and dtype, parameters
        re-pointed at slices of it (their values copied in)."""
        self._buffers = []
        self._parts_cache: list[tuple[int, list[torch.Tensor]]] | None = None
        self._part_layouts: dict[int, list[tuple[int, list[torch.Tensor]]]] = {}
        if not self.parameters_as_bucket_view or self.overlap_with_ddp:
            return  # with overlap, the parameters are views into DDP-bucket buffers
        for rank in range(self.world_size):
            for same in group_by_dtype(self.owned_params(rank)):
                flat = torch.cat([p.detach().reshape(-1) for p in same])  # 1D, owner's params
                offset = 0
                for p in same:
                    p.data = flat[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
                self._buffers.append((rank, flat))

    # -- hyper-parameters --------------------------------------------------------------------

    def _push_hyperparameters(self) -> None:
        """Copy every group's hyper-parameters (lr set by a scheduler...) to the local one."""
        if self.optim is None:
            return
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update(_hyper(group))

    def _pull_hyperparameters(self) -> None:
        """Copy back what the local optimizer's step changed or added in its groups."""
        if self.optim is None:
            return
        for group, local in zip(self.param_groups, self.optim.param_groups):
            for key, value in local.items():
                if key != "params" and group.get(key, _MISSING) is not value:
                    group[key] = value

    def _fill_missing_hyperparameters(self) -> None:
        """Give the public groups the optimizer class's defaults (betas, eps, ...)."""
        for group, local in zip(self.param_groups, self.optim.param_groups):
            for key, value in _hyper(local).items():
                group.setdefault(key, value)
        for key, value in self.optim.defaults.items():
            self.defaults.setdefault(key, value)

    # -- state dicts -------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state on rank ``to`` (collective: all ranks call it).
        Afterwards ``state_dict()`` on rank ``to`` returns the whole state, keyed by global
        parameter index like a plain optimizer's."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"to={to} is not a rank of this group (world size {self.world_size})")
        self._check_attached("consolidate_state_dict()")
        self._push_hyperparameters()
        if self._elements is not None:
            self._consolidate_elements(to)
            return
        mine = {} if self.optim is None else state_dicts.to_global(
            self.optim.state_dict(), self._partition[self.rank],
            [len(g["params"]) for g in self.param_groups])
        gathered = zc.gather_to(mine, to, self.process_group)
        self._consolidated = None
        if gathered is not None:
            self._consolidated = state_dicts.merge(gathered, self.param_groups)

    def _consolidate_elements(self, to: int) -> None:
        """Every rank's pieces' state gathered on rank ``to`` (one ``gather_object``) and
        joined into torch's whole-parameter state dict."""
        mine = self._elements.to_global(self.optim.state_dict())
        gathered = zc.gather_to(mine, to, self.process_group)
        self._consolidated = None
        if gathered is not None:
            params = [p for g in self.param_groups for p in g["params"]]
            whole = state_dicts.merge([], self.param_groups)
            whole["state"] = merge_pieces(gathered, params)
            self._consolidated = whole

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state, on the rank that ``consolidate_state_dict`` gathered it
        to; it reflects the state at that call."""
        if self._consolidated is None:
            raise RuntimeError(
                "ZeroRedundancyOptimizer.state_dict() needs the state gathered first: call "
                "consolidate_state_dict(to=rank) on every rank, then state_dict() on that rank"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole-optimizer state dict (from ``consolidate_state_dict`` at any world size,
        or from a plain optimizer over the same parameters); each rank keeps its partition."""
        self._check_attached("load_state_dict()")
        params = [g["params"] for g in self.param_groups]
        state_dicts.check_fits(state_dict, params)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(_hyper(saved))
        if self.optim is None:  # owns no bucket (overlap_with_ddp)
            return
        if self._elements is not None:
            local = self._elements.to_local(state_dict)
        else:
            local = state_dicts.to_local(state_dict, self._partition[self.rank], params)
        self.optim.load_state_dict(local)
        self.state = self.optim.state  # type: ignore[assignment]
        self._push_hyperparameters()

    def __repr__(self) -> str:
        if self._elements is not None:
            held = sum(piece.numel for piece, _, _ in self._elements.pieces)
            return (f"ZeroRedundancyOptimizer({self.optimizer_class.__name__}, rank {self.rank} "
                    f"of {self.world_size}, partition='elements', {held} elements held)")
        return (f"ZeroRedundancyOptimizer({self.optimizer_class.__name__}, rank {self.rank} of "
                f"{self.world_size}, {len(self.owned_params())} of "
                f"{sum(len(g['params']) for g in self.param_groups)} parameters owned)")


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: copy.copy(v) if isinstance(v, list) else v
            for k, v in group.items() if k != "params"}


def _weight(param: torch.Tensor) -> Weight:
    size = param.numel() * param.element_size()
    return (size, 0) if param.requires_grad else (0, size)


def _check_optimizer_class(optimizer_class: Any) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(
            "optimizer_class must be a torch.optim.Optimizer subclass such as "
            f"torch.optim.AdamW (the class, not an instance), got {optimizer_class!r}"
        )


def _check_element_options(optimizer_class: type[Optimizer], bucket_view: bool,
                           overlap: bool) -> None:
    if not is_element_wise(optimizer_class):
        raise ValueError(
            f"partition='elements' steps each rank's slices of the parameters, which gives the "
            f"right result only for an element-wise optimizer (AdamW, Adam, SGD, ...); "
            f"{optimizer_class.__name__} is not known to be one: use partition='parameters'")
    if bucket_view or overlap:
        what = "parameters_as_bucket_view" if bucket_view else "overlap_with_ddp"
        raise ValueError(f"partition='elements' does not combine with {what}=True (its "
                         "parameters already live in one flat buffer per dtype)")


def _check_params(params: list[torch.Tensor]) -> None:
    sparse = [i for i, p in enumerate(params) if p.layout != torch.strided]
    if sparse:
        raise ValueError(
            f"ZeroRedundancyOptimizer needs dense parameters; parameters {sparse} are "
            f"{params[sparse[0]].layout} (their updates could not be broadcast as flat buffers)"
        )
    kinds = sorted({p.device.type for p in params})
    if len(kinds) > 1:
        raise ValueError(
            f"ZeroRedundancyOptimizer needs all parameters on one device type, found {kinds}: "
            "move the model to one device before building the optimizer"
        )
