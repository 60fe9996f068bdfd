"""One FSDP unit: the module whose parameters are gathered and freed together, and its hooks.

The hooks (forward pre/post on the module, pre-backward on its outputs, post-accumulate-grad on
each unsharded parameter, the last of which is the unit's post-backward) move the unit between
SHARDED and UNSHARDED at the points described in [Note: FSDP schedule] (root.py); the root of a
tree of units coordinates ordering and prefetch.
"""

from __future__ import annotations

import weakref
from enum import Enum, auto
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise._compat import current_backward, tree_flatten, tree_map
from shardwise.dp.output_hooks import register_pre_backward
from shardwise.fsdp.collectives import run_eagerly
from shardwise.fsdp.flat_param import FlatParamHandle
from shardwise.fsdp.mixed_precision import MixedPrecision
from shardwise.fsdp.reduction import unit_tag_bases
from shardwise.fsdp.root import RootState
from shardwise.memory.heap import release_free_heap

UNIT_ATTR = "_shardwise_fsdp_unit"


class TrainingState(Enum):
    """Where a unit is in one iteration; every hook reads it ([Note: FSDP unit states])."""

    IDLE = auto()  # between iterations, and after the unit's forward until backward reaches it
    FORWARD = auto()  # inside the unit's forward (pre-forward ran, post-forward not yet)
    PRE_BACKWARD = auto()  # backward reached the unit: parameters gathered, gradients arriving
    POST_BACKWARD = auto()  # backward done with it: reduction issued (parameters resharded)


# [Note: FSDP unit states]
# IDLE -> FORWARD (pre-forward: gather, record the forward order) -> IDLE (post-forward: reshard
# unless backward needs the unit first). IDLE -> PRE_BACKWARD (the first gradient of one of the
# unit's outputs: gather, prefetch the next unit in backward order; later outputs' gradients
# find the unit already in PRE_BACKWARD and do nothing) -> POST_BACKWARD (where the unit's
# backward ends, see the next Note: reshard, reduce-scatter) -> IDLE (the root's end-of-backward
# callback, for every unit at once).
# A forward that runs while a backward is running is an activation-checkpoint recompute
# (torch.utils.checkpoint, reentrant or not, of the whole unit or inside it): it leaves the
# state as it is, records no forward order, gathers the parameters if they are not gathered
# and never reshards them, since the recomputed graph's backward is about to use them. A
# non-reentrant recompute may stop before the unit's post-forward runs; end-of-backward clears
# the recompute flag. Gradients are counted per parameter, once each: a parameter whose
# gradient arrives twice in one backward (used both inside and outside a reentrant checkpoint,
# whose inner backward delivers its gradient separately) is accumulated, and one that arrives
# after the unit's reduction was issued (POST_BACKWARD) goes into a new flat gradient that the
# end-of-backward callback reduces too: a reduce-scatter is linear, so the two reductions sum
# to the one the whole gradient would have had. tests/fsdp/test_fsdp_state_machine.py.

# [Note: backward with create_graph]
# A backward that builds a graph (``torch.autograd.grad(out, x, create_graph=True)`` for a
# gradient penalty, run before the loss's own backward) makes nodes that read the unsharded
# parameters again when that graph is differentiated. So while a backward runs with grad mode on
# (what create_graph does; the root reads it when the backward starts), no unit reshards or
# releases rows where its backward ends: the parameters stay gathered until the end of the next
# backward that builds no graph. Such a pass's reductions carry zeros for the parameters (no
# gradient reaches them). A parameter's gradient that carries a graph (``backward(create_graph=
# True)`` through the parameters) is an error that says so: the reduce-scatter is not
# differentiable. torch's FSDP2 (2.13) fails there on freed storage ("setStorage ... storage of
# size 0"). tests/fsdp/test_forward_patterns.py.

# [Note: where a unit's backward ends]
# Every rank must issue the units' reductions in the same order, and a rank whose control flow
# skipped a parameter (a branch or an expert that ran on other ranks only) gets no gradient for
# it. So the end of a unit's backward is not "every parameter's gradient is in", which comes on
# some ranks and never on others (a rank waiting for it would reach the end of backward first
# and reduce this unit after units that the other ranks reduced after it: reductions paired
# with the wrong units, or ranks waiting for each other). It is a point that every rank reaches:
# - when the unit's forward had inputs that require grad: once backward has computed all their
#   gradients (a hook on each, registered by the forward or, for a reentrant checkpoint whose
#   forward ran without grad, by its recompute). Autograd runs every node made during the
#   unit's forward before the node that made its inputs, and a parameter's AccumulateGrad as
#   soon as it is ready, so the gradients that arrive at all are in by then;
# - otherwise (the root, whose inputs are data; a unit after frozen layers): the root's
#   end-of-backward callback, for these units in the root's order.
# A unit run several times before one backward (two forwards of the model for one loss, a
# block applied twice) counts its forwards, and its backward ends when the inputs of the last
# of them have their gradients. The count is cleared where backward ends (the end-of-backward
# callback); when the root's forward starts again, only the forwards whose graph is gone are
# forgotten (an evaluation with grad enabled whose output was dropped: each forward's record
# lives in its graph, in its first input's node metadata and in the hooks, and the unit holds it
# weakly; nothing in it refers back to the graph, so the graph is freed as soon as it is
# dropped), so a second forward of the model before backward keeps the first one's
# (tests/fsdp/test_forward_patterns.py). A forward counted too long, or an input whose gradient
# this backward does not compute, only moves the unit's end to the callback: later, still the
# same point on every rank.
# Each rank then reduces every parameter, with zeros for the ones it got no gradient for, even a
# unit none of whose gradients arrived here (``expect_gradient``). A parameter that no rank used
# still keeps ``grad is None`` ([Note: gradients of unused parameters], reduction.py). The
# direct exchanges that do run while the unit's backward goes on never wait without end for a
# peer ([Note: direct gradient reduction]). tests/fsdp/test_direct_reduction.py.

# [Note: one unit over several modules]
# ``fully_shard([norm, head])`` (torch FSDP2's list form, for modules that run together or share
# a parameter) makes one unit whose flat parameters are those of all the modules: one gather and
# one reduction for all of them. Each module carries the unit (``_shardwise_fsdp_unit``) and
# becomes an ``FSDPModule`` of it; ``unit.module`` is the first, ``unit.modules`` all of them.
# Every module's forward runs the unit's forward hooks, so the unit behaves as a module applied
# once per module in a forward: its backward ends once the inputs of all those forwards have
# their gradients ([Note: where a unit's backward ends]). After forward it reshards only when
# every module of the list has run in this forward, so the second module does not gather again.
# A parameter's names are relative to the module of the list that holds it, and ``slot.homes``
# says which one (state_dict.py loads and gathers each module's names under its own prefix).
# tests/fsdp/test_module_list.py.


class FSDPUnit:
    """Runtime state of one unit (stored on its modules as ``_shardwise_fsdp_unit``)."""

    def __init__(self, module: nn.Module, handle: FlatParamHandle | None,
                 group: dist.ProcessGroup, reshard_after_forward: bool,
                 mixed_precision: MixedPrecision | None, children: list[FSDPUnit],
                 modules: list[nn.Module] | None = None):
        self.module = module
        # every module of the unit, ``module`` first: [Note: one unit over several modules]
        self.modules = list(modules) if modules else [module]
        self._forwards_left: set[int] = set()  # ids of modules yet to run in this forward
        self.handle = handle
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.mixed_precision = mixed_precision
        self.children = children
        self.forward_prefetch = False  # on the root: prefetch the next unit during forward
        self.parent: FSDPUnit | None = None
        self.root_state: RootState | None = None
        self.is_root = False
        self.no_sync = False  # keep unsharded gradients, no reduce-scatter (no_sync())
        # keep zero gradients for parameters no rank used: [Note: gradients of unused parameters]
        self.reduce_scatter_unused_params = False
        self.state = TrainingState.IDLE
        self.recomputing = False  # a forward run during backward (activation checkpointing)
        self.late_grads = False  # gradients arrived in POST_BACKWARD, reduced at the end
        # forwards whose inputs' gradients backward has not produced: id -> a weak reference
        # to the forward's _ForwardInputs, which lives in its graph (see _watch_inputs)
        self._inputs_pending: dict[int, weakref.ref] = {}
        self._inputs_watched = 0  # forwards of this iteration whose inputs are watched
        self.forward_index = -1  # position of the current call in the forward order
        self.reshard_after_backward = True
        # off once the unit's forward ran a reentrant checkpoint inside it: see
        # the rows' release in [Note: releasing a dead parameter's rows]
        self.release_rows = True
        # set_modules_to_{forward,backward}_prefetch: None follows the recorded order
        self.forward_prefetch_units: list[FSDPUnit] | None = None
        self.backward_prefetch_units: list[FSDPUnit] | None = None
        for child in children:
            child.parent = self
        # outside any compiled region: see [Note: FSDP under torch.compile]
        for each in self.modules:
            each.register_forward_pre_hook(run_eagerly(self._pre_forward), with_kwargs=True)
            each.register_forward_hook(run_eagerly(self._post_forward))
            each.register_forward_hook(run_eagerly(self._forward_raised), always_call=True)
        self._hook_leaves()

    def _hook_leaves(self) -> None:
        for index, leaf in enumerate(self.handle.leaves if self.handle is not None else []):
            leaf.register_post_accumulate_grad_hook(partial(self._on_param_grad, index))

    def adopt_applied_params(self) -> None:
        """The module was moved or converted (``_apply``): new buffers, new leaves to hook."""
        self.handle.adopt_applied_params()
        self._hook_leaves()

    # ---- by hand (FSDPModule.unshard / reshard) -------------------------------------------
    def start_manual_unshard(self) -> None:
        if self.handle is not None:
            self.handle.start_unshard()

    def finish_manual_unshard(self) -> None:
        if self.handle is not None:
            self.handle.finish_unshard()
            self.handle.use_unsharded_views()

    def manual_reshard(self) -> None:
        if self.handle is not None:
            self.handle.reshard()

    def subtree(self) -> list[FSDPUnit]:
        """This unit and every unit below it, parents first."""
        out = [self]
        for child in self.children:
            out += child.subtree()
        return out

    @property
    def backward_done(self) -> bool:
        """Gradient reduction issued for this backward."""
        return self.state is TrainingState.POST_BACKWARD

    def end_backward(self) -> None:
        """The backward pass is over (the root's callback): back to IDLE."""
        self.state = TrainingState.IDLE
        self.recomputing = self.late_grads = False
        self._inputs_pending.clear()
        self._inputs_watched = 0

    def forget_dropped_forwards(self) -> None:
        """Stop counting the forwards whose graph is gone (their output was dropped unused: an
        evaluation with grad enabled), when a new iteration's forward starts: their inputs'
        gradients will never come ([Note: where a unit's backward ends])."""
        pending = self._inputs_pending
        for key in [k for k, ref in pending.items() if ref() is None]:
            del pending[key]
        self._inputs_watched = len(pending)

    def needs_gradients(self) -> bool:
        return self.handle is not None and self.handle.requires_grad

    # ---- forward ------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self.parent is not None:
            top = self.parent
            while top.parent is not None:
                top = top.parent
            raise RuntimeError(
                f"FSDP: {class_name(self.module)} ran forward before the root unit "
                f"{class_name(top.module)} that contains it ever did; the root decides the "
                "order of gathers and frees for the whole tree, so call the root module first "
                "(or apply fully_shard to the standalone module only)")
        self.is_root = True
        units = self.subtree()
        state = RootState(units, max_inflight_gathers=2 if self.forward_prefetch else 1)
        bases = unit_tag_bases([len(u.handle.slots) if u.handle else 0 for u in units])
        for unit, tag_base in zip(units, bases):
            unit.root_state = state
            if unit.handle is not None:
                unit.handle.storage_pool = state.storage_pool
                unit.handle.tag_base = tag_base

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.root_state is None:
            self._lazy_init()
        self.root_state.end_abandoned_backward()  # [Note: a backward that raised] (root.py)
        if self.root_state.in_backward:
            self._pre_recompute()
            if not self._inputs_watched:  # a reentrant checkpoint's forward ran without grad
                args, kwargs = self._watch_inputs(args, kwargs)
        else:
            if self.is_root:
                self.root_state.sync_host()  # the peers' rows are written
                self.root_state.start_forward()
                for unit in self.root_state.units:
                    unit.forget_dropped_forwards()
                    unit._forwards_left.clear()  # a module of the unit that did not run
            self.state = TrainingState.FORWARD
            if not self._forwards_left:  # the first of the unit's modules in this forward
                self._forwards_left = {id(m) for m in self.modules}
            args, kwargs = self._watch_inputs(args, kwargs)
            self.root_state.unshard_for_forward(self, self.forward_prefetch_units)
            self.root_state.storage_pool.clear()  # untaken: [Note: unshard buffer pool]
            if self.handle is not None:
                self.handle.use_unsharded_views()
        mp = self.mixed_precision
        if mp is not None and mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
        return args, kwargs

    def _watch_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Make the gradients of this forward's inputs the end of the unit's backward (see
        [Note: where a unit's backward ends]). Returns the inputs the forward runs with: an
        input that is a leaf requiring grad (data for an input gradient, a parameter passed in)
        becomes a view of itself, with the same values and gradient, so that the forward's
        graph has a node to hold its record."""
        if not torch.is_grad_enabled() or self.handle is None:
            return args, kwargs
        args, kwargs = tree_map(_view_of_leaf, (args, kwargs))
        leaves, _ = tree_flatten((args, kwargs))
        inputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if inputs:
            watch = _ForwardInputs(len(inputs))
            # the graph holds the watch (its first input's node metadata, and the hooks) and the
            # unit holds it weakly; the watch refers to nothing in the graph, so it dies with it
            inputs[0].grad_fn.metadata.setdefault(_WATCHES_KEY, []).append(watch)
            self._inputs_pending[id(watch)] = weakref.ref(watch)
            self._inputs_watched += 1
            for index, tensor in enumerate(inputs):
                tensor.register_hook(partial(self._on_input_grad, watch, index))
        return args, kwargs

    def _on_input_grad(self, watch: _ForwardInputs, index: int, grad: torch.Tensor) -> None:
        if not watch.arrived(index):
            return
        self._inputs_pending.pop(id(watch), None)
        if self.state is TrainingState.PRE_BACKWARD and not self._inputs_pending:
            self._post_backward()

    def grads_arrived(self) -> bool:
        """Whether a gradient of this unit arrived in this backward ([Note: gradient
        arrival])."""
        return self.handle is not None and self.handle.arrivals.any_now()

    def _pre_recompute(self) -> None:
        """A forward during backward (see [Note: FSDP unit states]): parameters gathered and in
        place, the state and the forward order left alone."""
        self.recomputing = True
        if self.handle is not None:
            self.handle.finish_unshard()  # no collective when already gathered
            if not self.handle.views_set:
                self.handle.use_unsharded_views()

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.recomputing:  # parameters stay: the recomputed graph's backward needs them
            self.recomputing = False
            register_pre_backward(output, self._pre_backward)
            return self._cast_output(output)
        self.state = TrainingState.IDLE
        grad = torch.is_grad_enabled()
        if grad and self.release_rows and _runs_reentrant_checkpoint(args, output):
            self.release_rows = False
        self._forwards_left.discard(id(module))
        if self.handle is not None:
            keep = grad and (self.is_root or not self.reshard_after_forward
                             or self.root_state.runs_last(self))
            if not keep and not self._forwards_left:  # every module of the unit ran
                self.handle.reshard()
        if self.is_root:  # forward is over: [Note: unshard buffer pool]
            self.root_state.storage_pool.clear()
            self.root_state.sync_host()  # the peers are done reading this rank's rows
        register_pre_backward(output, self._pre_backward)
        return self._cast_output(output)

    def _forward_raised(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Runs after ``_post_forward`` and, unlike it, also when the forward raised
        (``always_call``). A unit still in FORWARD then had its forward raise: it reshards and
        goes back to IDLE, so a state dict or ``summon_full_params`` in the exception handler
        sees the shards. No collective: the other ranks may not have raised."""
        if self.state is not TrainingState.FORWARD:
            return
        self.state = TrainingState.IDLE
        self._forwards_left.clear()
        if self.handle is not None:
            self.handle.reshard()
        if self.is_root:
            self.root_state.storage_pool.clear()

    def _cast_output(self, output: Any) -> Any:
        mp = self.mixed_precision
        if mp is not None and getattr(mp, "output_dtype", None) is not None:
            output = _cast_floats(output, mp.output_dtype)
        return output

    # ---- backward -----------------------------------------------------------------------
    def _pre_backward(self) -> None:
        first = self.root_state.enter_backward()
        if first and self.handle is not None and self.handle.compute_device.type == "cpu":
            release_free_heap()  # where backward starts: [Note: allocator slack] (memory/heap.py)
        if self.state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            return  # another output of the unit, or a recomputed one: already done
        self.state = TrainingState.PRE_BACKWARD
        if self.handle is not None:
            handle = self.handle
            handle.start_unshard()
            if self.backward_prefetch_units is None:
                self.root_state.prefetch_for_backward(self)
            else:
                for unit in self.backward_prefetch_units:
                    if not unit.backward_done and unit.handle is not None:
                        unit.handle.start_unshard()
            handle.finish_unshard()
            if not handle.views_set:  # resharded after forward (e.g. recomputed by checkpointing)
                handle.use_unsharded_views()

    def reshards_after_backward(self) -> bool:
        """Whether the unit reshards where its backward ends ([Note: backward with
        create_graph])."""
        return self.reshard_after_backward and not self.root_state.building_graph

    def _on_param_grad(self, index: int, leaf: torch.Tensor) -> None:
        """One parameter's gradient is complete: into the flat gradient with it (each counted
        once; a late or repeated one: [Note: FSDP unit states]). It does not end the unit's
        backward: [Note: where a unit's backward ends]."""
        if leaf.grad is not None and leaf.grad.requires_grad:  # [Note: backward with create_graph]
            raise RuntimeError(
                f"FSDP: {class_name(self.module)}'s parameters got gradients that carry a graph "
                "(backward with create_graph=True): their reduce-scatter is not differentiable, "
                "so higher-order gradients through them would be wrong. Gradients with respect "
                "to inputs with create_graph=True (torch.autograd.grad(out, x, "
                "create_graph=True), as a gradient penalty takes) are supported.")
        if self.state is TrainingState.POST_BACKWARD:
            # into new gradients, reduced at the end
            self.handle.add_param_grad(index, sync=not self.no_sync)
            self.late_grads = True
            return
        if not self.handle.arrivals.any_now():
            # the unit's first gradient in this backward: finish the reduction in flight before
            # this unit's flat gradient is allocated (see [Note: FSDP schedule])
            self.root_state.finish_reductions()
        self.handle.add_param_grad(index, sync=not self.no_sync)
        if self.release_rows and self.reshards_after_backward() and not self.recomputing:
            self.handle.release_param_rows(index)  # [Note: releasing a dead parameter's rows]

    def _post_backward(self) -> None:
        """The unit's backward is over ([Note: where a unit's backward ends]): reshard, and
        reduce every parameter's gradient (zeros where none arrived here)."""
        self.state = TrainingState.POST_BACKWARD
        if self.reshards_after_backward():
            self.handle.reshard()  # parameters first: free their buffer before reductions'
        if self.backward_prefetch_units is None:
            self.root_state.prefetch_for_backward(self)
        self.root_state.storage_pool.clear()  # what no prefetch took: [Note: unshard buffer pool]
        self.reduce_gradient(take_part=True)

    def reached_by_backward(self) -> bool:
        """Backward reached the unit's outputs and its backward has not ended yet."""
        return self.state is TrainingState.PRE_BACKWARD

    def end_backward_at_callback(self) -> None:
        """The end of backward ends this unit's too (no watched inputs, see the Note)."""
        self.state = TrainingState.POST_BACKWARD
        if self.handle is not None:
            self.reduce_gradient(take_part=True)

    def reduce_gradient(self, take_part: bool = False) -> None:
        """Issue the reduce-scatter of the flat gradient (unless gradient sync is off).
        ``take_part``: the unit's backward ended on every rank at this point, so this rank
        reduces even if none of its gradients arrived here (zeros, see the Note)."""
        if self.no_sync:
            return
        if take_part and self.needs_gradients():
            self.handle.expect_gradient()
        if self.handle.has_gradient():
            self.root_state.make_room_for_reduction()
            self.root_state.add_reduction(self, self.handle.start_reduction())


# [Note: releasing a dead parameter's rows]
# A parameter's post-accumulate-grad hook runs once autograd has run every node of the backward
# graph that uses the parameter (they all feed its AccumulateGrad), so nothing in this backward
# reads its unsharded rows again, although the unit's other parameters are still in use. So the
# pages under a large ("direct") parameter's rows of the unit's unsharded buffer are given back
# to the OS then (``madvise(MADV_DONTNEED)``, memory/heap.py), not when the unit's backward
# ends: at the backward peak the unit's parameters that are done stop costing memory while the
# next unit's gather arrives. The buffer itself is freed when the unit reshards, as before, and
# the next gather writes every row of a new one, so the released (now zero) pages are never
# read. Not done where the rows may still be read: the unit keeps its parameters after backward
# (``reshard_after_backward=False``), a forward is being recomputed, or the unit's forward ran a
# reentrant checkpoint inside it (its recompute happens in backward, outside this graph's
# dependencies, and may use a parameter whose gradient from outside the checkpoint arrived
# already); and only on Linux and the CPU. tests/fsdp/test_fsdp_memory.py.


def _runs_reentrant_checkpoint(args: Any, output: Any) -> bool:
    """Whether the autograd graph between a unit's inputs and ``output`` holds a reentrant
    checkpoint's node (its recompute runs forward again during backward)."""
    leaves, _ = tree_flatten(args)
    stop = {t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    outs, _ = tree_flatten(output)
    todo = [t.grad_fn for t in outs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set(stop)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        todo.extend(n for n, _ in node.next_functions if n is not None and n not in seen)
    return False


class _ForwardInputs:
    """One forward's inputs that require grad, and which of them have their gradient in the
    backward pass now running."""

    def __init__(self, count: int):
        self.count, self.backward, self.seen = count, -1, set()

    def arrived(self, index: int) -> bool:
        """Input ``index`` has its gradient; whether every input has, in this backward."""
        backward = current_backward()
        if backward != self.backward:  # another backward through a retained graph
            self.backward, self.seen = backward, set()
        self.seen.add(index)
        return len(self.seen) == self.count


_WATCHES_KEY = "shardwise_fsdp_forwards"


def _view_of_leaf(x: Any) -> Any:
    """``x`` itself, or a view of it where it is a leaf tensor that requires grad."""
    if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf:
        return x.view_as(x)
    return x


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def class_name(module: nn.Module) -> str:
    """The module's own class name (not the ``FSDP...`` class fully_shard gives it)."""
    return getattr(type(module), "_fsdp_orig_cls", type(module)).__name__


def get_unit(module: nn.Module) -> FSDPUnit | None:
    """The FSDP unit whose module is ``module`` (None if it is not one)."""
    return getattr(module, UNIT_ATTR, None)


def units_of(module: nn.Module) -> list[FSDPUnit]:
    """Every unit at or below ``module``, parents before children, each once (a unit over
    several modules is reached from each of them)."""
    return list(dict.fromkeys(u for m in module.modules() if (u := get_unit(m)) is not None))
