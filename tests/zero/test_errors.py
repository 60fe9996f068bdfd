"""Bad input to ZeroRedundancyOptimizer gets a clear error."""

import pytest
import torch

from shardwise import ZeroRedundancyOptimizer
from tests.harness import run_on_ranks


def _errors(ctx):
    net = torch.nn.Linear(3, 3)
    with pytest.raises(TypeError, match="optimizer_class must be a torch.optim.Optimizer "
                                        "subclass.*got <class 'torch.nn.modules.linear.Linear'>"):
        ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.nn.Linear, lr=0.1)
    instance = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"the class, not an instance"):
        ZeroRedundancyOptimizer(net.parameters(), optimizer_class=instance, lr=0.1)
    on_meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match=r"one device type, found \['cpu', 'meta'\]"):
        ZeroRedundancyOptimizer([*net.parameters(), on_meta], torch.optim.SGD, lr=0.1)
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"one device type, found \['cpu', 'meta'\]"):
        opt.add_param_group({"params": [on_meta]})
    assert len(opt.param_groups) == 1  # the rejected group was not added
    unattached = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD,
                                         overlap_with_ddp=True, lr=0.1)
    for call in (unattached.step, lambda: unattached.consolidate_state_dict(0)):
        with pytest.raises(RuntimeError, match=r"not attached to a DistributedDataParallel.*"
                                               r"hook_with_zero_step"):
            call()
    with pytest.raises(ValueError, match=r"to=3 is not a rank of this group"):
        ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD,
                                lr=0.1).consolidate_state_dict(to=3)


def test_bad_input_errors():
    run_on_ranks(1, _errors)
