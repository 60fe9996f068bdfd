"""shardwise.DistributedDataParallel is a torch DistributedDataParallel to isinstance checks, keeps
torch's public attributes, and refuses every torch method it does not implement with a
NotImplementedError that says what to use instead (src/shardwise/ddp/torch_ddp.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from shardwise import DistributedDataParallel
from shardwise.ddp.torch_ddp import TorchOnlyAttribute, refused_methods, torch_only_attributes
from tests.harness import run_on_ranks

# torch's class members that ours keeps as torch defines them: they work on ours as they are
KEPT_FROM_TORCH = {"train", "_get_active_ddp_module", "_get_data_parallel_params",
                   "_set_params_and_buffers_to_ignore_for_model", "_distributed_rank",
                   "_active_ddp_module"}


def _torch_members() -> set[str]:
    return {name for name, value in vars(TorchDDP).items()
            if not (name.startswith("__") and name.endswith("__")) and name not in
            {"_abc_impl"}}


def test_every_torch_member_is_ours_kept_or_refused():
    ours = set(vars(DistributedDataParallel))
    refused = set(refused_methods())
    unaccounted = _torch_members() - ours - refused - KEPT_FROM_TORCH - {"broadcast_buffers"}
    assert unaccounted == set(), "torch DDP members neither implemented nor refused"
    assert not refused & ours, "a refused method is also implemented"
    for name in ("forward", "no_sync", "join", "join_hook", "register_comm_hook",
                 "_set_static_graph", "_get_ddp_logging_data", "will_sync_module_buffers"):
        assert name in ours, name


def _wrapped(ctx):
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)),
                                    process_group=ctx.group)
    checks = {
        "isinstance": isinstance(model, TorchDDP) and isinstance(model, nn.Module),
        "module": isinstance(model.module, nn.Sequential),
        "attrs": (model.process_group is ctx.group, model.device_ids, model.output_device,
                  model.find_unused_parameters, model.static_graph, model.broadcast_buffers,
                  model.dim, model.gradient_as_bucket_view),
        "keys": list(model.state_dict()),
        "names": [n for n, _ in model.named_parameters()],
        "logging": model._get_ddp_logging_data(),
        "rank": model._distributed_rank,
        "forward_sync": model.require_forward_param_sync,
        "will_sync": model.will_sync_module_buffers(),
        "train_returns_self": model.train() is model,
    }
    refusals = {}
    for name in refused_methods():
        with pytest.raises(NotImplementedError) as err:
            getattr(model, name)(None)
        refusals[name] = str(err.value)
    for name in torch_only_attributes():
        assert not hasattr(model, name), name
        with pytest.raises(NotImplementedError, match=f"{name} is an attribute of torch's"):
            getattr(model, name)
    with pytest.raises(AttributeError) as err:  # any other name: nn.Module's error, as before
        model.no_such_thing  # noqa: B018
    assert not isinstance(err.value, NotImplementedError)
    model.require_forward_param_sync = False
    checks["forward_sync_after_set"] = model.require_forward_param_sync
    checks["will_sync_after_set"] = model.will_sync_module_buffers()
    with model.no_sync():
        checks["no_sync_flag"] = model.require_backward_grad_sync
    return checks, refusals


def test_our_ddp_is_torch_ddp_to_isinstance_and_refuses_torch_only_methods():
    for rank, (checks, refusals) in enumerate(run_on_ranks(2, _wrapped)):
        assert checks["isinstance"] and checks["module"]
        assert checks["attrs"] == (True, None, None, False, False, True, 0, False)
        assert checks["keys"] == ["module.0.weight", "module.0.bias", "module.1.weight",
                                  "module.1.bias", "module.1.running_mean",
                                  "module.1.running_var", "module.1.num_batches_tracked"]
        assert checks["names"] == ["module.0.weight", "module.0.bias", "module.1.weight",
                                   "module.1.bias"]
        log = checks["logging"]
        assert (log["world_size"], log["rank"], log["backend_name"]) == (2, rank, "gloo")
        assert log["num_parameter_tensors"] == 4 and log["static_graph"] == 0
        assert "can_set_static_graph" not in log  # not tracked: absent, not a guess
        assert checks["rank"] == rank
        assert checks["forward_sync"] and checks["will_sync"]
        assert not checks["forward_sync_after_set"] and not checks["will_sync_after_set"]
        assert checks["no_sync_flag"] is False
        assert checks["train_returns_self"]
        for name, message in refusals.items():
            assert f"DistributedDataParallel.{name}() is torch's DistributedDataParallel" \
                   f".{name}; on shardwise.DistributedDataParallel it cannot work: " in message


def test_torch_only_attribute_is_both_attribute_error_and_not_implemented():
    assert issubclass(TorchOnlyAttribute, AttributeError)
    assert issubclass(TorchOnlyAttribute, NotImplementedError)


def _ignored(ctx):
    model = nn.Linear(2, 2)
    TorchDDP._set_params_and_buffers_to_ignore_for_model(model, ["bias"])
    with pytest.raises(NotImplementedError, match="marked to be ignored"):
        DistributedDataParallel(model, process_group=ctx.group)


def test_parameters_marked_ignored_for_torch_ddp_are_refused():
    run_on_ranks(1, _ignored)
