"""Element-wise ops, activations, and ops that act along dims no shard cuts.

Element-wise: each local shard is computed from the matching boxes of the other operands (a
ShardedTensor with the same layout contributes its shard; a whole tensor is broadcast to the
sharded tensor's size and its box taken; scalars pass through). No communication. In-place ops
(``add_``, ``mul_``, ...) change the local shards and return the ShardedTensor itself.

Along-dim ops (softmax, log_softmax, layer_norm) run locally when every shard holds the whole of
the dims they act on, and are refused otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.sharded_tensor import comm
from shardwise.sharded_tensor.dispatch import implements, unsupported
from shardwise.sharded_tensor.layout import bind
from shardwise.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from shardwise.sharded_tensor.sharded_tensor import ShardedTensor

T = torch.Tensor
_UNARY = [torch.neg, torch.abs, torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.tanh,
          torch.sigmoid, torch.relu, torch.square, torch.sin, torch.cos, torch.erf,
          F.relu, F.gelu, F.silu, F.tanh, F.sigmoid, F.leaky_relu, F.elu,
          T.neg, T.abs, T.exp, T.log, T.sqrt, T.rsqrt, T.tanh, T.sigmoid, T.relu, T.square,
          T.__neg__, T.__abs__, T.float, T.double, T.half, T.bfloat16, T.to, T.type_as,
          T.clone, T.detach, T.contiguous]
_BINARY = [torch.add, torch.sub, torch.mul, torch.div, torch.pow, torch.maximum, torch.minimum,
           torch.where, torch.clamp, torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge,
           T.add, T.sub, T.mul, T.div, T.pow, T.clamp, T.eq, T.ne, T.lt, T.le, T.gt, T.ge,
           T.__add__, T.__radd__, T.__sub__, T.__rsub__, T.__mul__, T.__rmul__, T.__truediv__,
           T.__rtruediv__, T.__pow__, T.__rpow__, T.__eq__, T.__ne__, T.__lt__, T.__le__,
           T.__gt__, T.__ge__, torch.lerp, torch.addcmul, torch.addcdiv]
_INPLACE = [T.add_, T.sub_, T.mul_, T.div_, T.zero_, T.fill_, T.copy_, T.clamp_, T.relu_,
            T.neg_, T.requires_grad_, T.lerp_, T.addcmul_, T.addcdiv_, T.__iadd__, T.__isub__,
            T.__imul__, T.__itruediv__, F.relu_]


def _sharded_args(obj: Any) -> list[ShardedTensor]:
    if isinstance(obj, ShardedTensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [s for o in obj for s in _sharded_args(o)]
    if isinstance(obj, dict):
        return [s for o in obj.values() for s in _sharded_args(o)]
    return []


def _localise(obj: Any, k: int, ref: ShardedTensor, func: Callable, all_args) -> Any:
    """Operand ``obj`` restricted to ``ref``'s k-th local shard."""
    if isinstance(obj, ShardedTensor):
        return obj.local_shards()[k].tensor
    if isinstance(obj, torch.Tensor) and obj.dim() > 0:
        try:
            whole = obj.broadcast_to(ref.shape)
        except RuntimeError:
            raise unsupported(func, all_args, f"a plain operand of size {tuple(obj.shape)} does "
                              f"not broadcast to the sharded size {tuple(ref.shape)}") from None
        return whole[ref.local_shards()[k].metadata.region()]
    if isinstance(obj, (list, tuple)):
        return type(obj)(_localise(o, k, ref, func, all_args) for o in obj)
    return obj


def _reference(func, args, kwargs) -> ShardedTensor:
    sharded = _sharded_args((args, kwargs))
    ref = sharded[0]
    for other in sharded[1:]:
        if not other.metadata().same_layout(ref.metadata()):
            raise unsupported(func, (args, kwargs), "sharded operands must have the same layout; "
                              "reshard one to the other's spec")
    return ref


def _needs_grad(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.requires_grad
    if isinstance(obj, (list, tuple)):
        return any(_needs_grad(o) for o in obj)
    if isinstance(obj, dict):
        return any(_needs_grad(o) for o in obj.values())
    return False


def _check_every_rank_holds(func, args, kwargs, ref: ShardedTensor) -> None:
    # A rank without shards would never run the all-reduce of a whole operand's gradient.
    world = dist.get_world_size(ref.process_group)
    empty = sorted(set(range(world)) - {m.rank for m in ref.metadata().shards_metadata})
    if empty and _needs_grad((args, kwargs)):
        raise unsupported(func, (args, kwargs), f"ranks {empty} hold no shard, so a whole "
                          "operand that needs a gradient cannot be reduced over the group")


def _replicated(obj: Any, group) -> Any:
    """Whole tensors that need a gradient enter through ``copy_to_parallel``: each rank uses
    only its boxes of them, so their gradient is the sum of every rank's (all-reduce)."""
    if isinstance(obj, torch.Tensor) and obj.requires_grad:
        return comm.copy_to_parallel(obj, group)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replicated(o, group) for o in obj)
    return obj


def _map_shards(func, args, kwargs) -> tuple[ShardedTensor, list[torch.Tensor]]:
    ref = _reference(func, args, kwargs)
    _check_every_rank_holds(func, args, kwargs, ref)
    args = _replicated(args, ref.process_group)
    kwargs = {n: _replicated(v, ref.process_group) for n, v in kwargs.items()}
    outs = []
    for k in range(len(ref.local_shards())):
        la = _localise(args, k, ref, func, (args, kwargs))
        lk = {n: _localise(v, k, ref, func, (args, kwargs)) for n, v in kwargs.items()}
        outs.append(func(*la, **lk))
    return ref, outs


def _result(ref: ShardedTensor, outs: list[torch.Tensor], func, args) -> ShardedTensor:
    for out, shard in zip(outs, ref.local_shards()):
        if tuple(out.shape) != shard.metadata.shard_sizes:
            raise unsupported(func, args, "the result does not keep the sharded tensor's size")
    old = ref.metadata()
    dtype = outs[0].dtype if outs else old.tensor_properties.dtype
    rg = any(o.requires_grad for o in outs)
    meta = ShardedTensorMetadata(old.shards_metadata, old.size, TensorProperties(dtype, rg))
    return ref._with_local(outs, meta=meta)


@implements(*_UNARY, *_BINARY)
def elementwise(func, args, kwargs):
    ref, outs = _map_shards(func, args, kwargs)
    return _result(ref, outs, func, (args, kwargs))


@implements(*_INPLACE)
def elementwise_inplace(func, args, kwargs):
    target = args[0]
    if not isinstance(target, ShardedTensor):
        raise unsupported(func, (args, kwargs), "an in-place op cannot write a sharded result "
                          "into a plain tensor")
    _map_shards(func, args, kwargs)
    return target


@implements(F.dropout, T.__bool__)
def refused(func, args, kwargs):
    if func is F.dropout:
        a = bind(args, kwargs, ("input", "p", "training", "inplace"), p=0.5, training=True)
        if not a["training"] or a["p"] == 0:
            return a["input"]
        raise unsupported(func, (args, kwargs), "random masks drawn per shard would differ "
                          "from one process's; use dropout on whole activations")
    raise unsupported(func, (args, kwargs), "the truth value of a sharded tensor needs a gather")


def _along_dims(func, args, kwargs, st: ShardedTensor, dims: list[int]):
    """Run ``func`` on each shard when no shard cuts ``dims``; only ``st`` is localised."""
    size = st.shape
    for shard in st.local_shards():
        for d in dims:
            if shard.metadata.shard_sizes[d] != size[d]:
                raise unsupported(func, (args, kwargs), f"dim {d} is split across shards; the "
                                  "op needs it whole on one rank")
    _check_every_rank_holds(func, args[1:], kwargs, st)
    rest = _replicated(args[1:], st.process_group)
    kwargs = {n: _replicated(v, st.process_group) for n, v in kwargs.items()}
    outs = [func(s.tensor, *rest, **kwargs) for s in st.local_shards()]
    return _result(st, outs, func, (args, kwargs))


@implements(F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, T.softmax, T.log_softmax)
def softmax(func, args, kwargs):
    st = args[0]
    dim = kwargs["dim"] if "dim" in kwargs else args[1]
    return _along_dims(func, args, kwargs, st, [dim % st.dim()])


@implements(F.layer_norm)
def layer_norm(func, args, kwargs):
    st, shape = args[0], tuple(args[1] if len(args) > 1 else kwargs["normalized_shape"])
    if not isinstance(st, ShardedTensor):
        raise unsupported(func, (args, kwargs), "only the input may be sharded")
    dims = list(range(st.dim() - len(shape), st.dim()))
    return _along_dims(func, args, kwargs, st, dims)
