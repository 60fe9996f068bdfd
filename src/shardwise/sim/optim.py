"""AdamW with an fp32 master copy of 16-bit parameters: the ZeRO paper's mixed precision.

`shardwise plan --precision mixed` counts 2 + 2 + 12 bytes per parameter (16-bit parameters and
gradients; an fp32 master copy and fp32 moments: see [Note: model-state estimates] in
memory/estimate.py). torch's AdamW keeps its moments in the parameter's dtype and no master
copy, so a dry run in mixed precision steps this optimizer instead: per parameter it keeps
``master`` (fp32), ``exp_avg`` and ``exp_avg_sq`` (fp32) and a float32 ``step``, updates the
master copy in fp32 and copies it back into the 16-bit parameter. The update is AdamW's
(decoupled weight decay, bias-corrected moments); everything stays a tensor operation, so it
runs on fake tensors too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class MasterWeightAdamW(torch.optim.Optimizer):
    # its update of each element reads only that element's gradient and state: ZeRO's element
    # partition may step it on slices of parameters ([Note: ZeRO element partition])
    element_wise = True

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch's signature
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["master"] = p.detach().float().clone()
            state["exp_avg"] = torch.zeros_like(state["master"])
            state["exp_avg_sq"] = torch.zeros_like(state["master"])
        b1, b2 = group["betas"]
        g, master = p.grad.float(), state["master"]
        state["step"].add_(1)
        state["exp_avg"].lerp_(g, 1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1 = 1 - torch.pow(b1, state["step"])
        bc2 = 1 - torch.pow(b2, state["step"])
        denom = (state["exp_avg_sq"] / bc2).sqrt_().add_(group["eps"])
        master.mul_(1 - group["lr"] * group["weight_decay"])
        master.addcdiv_(state["exp_avg"] / bc1, denom, value=-group["lr"])
        p.copy_(master)
