"""One optimizer step for every instance of a horizontal array (HFTA's fused
optimizer): each parameter is a stacked `[N, ...]` tensor, and each hyper-parameter a
value per instance, broadcast along the instance dimension. The arithmetic is torch's
SGD and Adam (their default, non-foreach formulas) with a per-instance learning rate,
momentum, betas, eps and weight decay, so instance i's weights follow exactly what
`torch.optim.SGD/Adam` would do to instance i alone (tested)."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch


def _per_instance(value, n: int, name: str) -> torch.Tensor:
    values = torch.as_tensor(value, dtype=torch.float64).reshape(-1)
    if values.numel() == 1:
        values = values.expand(n)
    if values.numel() != n:
        raise ValueError(f"{name}: one value or one per instance ({n}), got {values.numel()}")
    return values.clone()


def _along(values: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Per-instance values shaped to broadcast against a stacked parameter."""
    return values.to(p.dtype).reshape((-1,) + (1,) * (p.dim() - 1))


class _Stacked(torch.optim.Optimizer):
    def __init__(self, params: Iterable[torch.Tensor], defaults: dict):
        params = list(params)
        if not params:
            raise ValueError("no parameters to optimize")
        n = params[0].shape[0]
        if any(p.dim() == 0 or p.shape[0] != n for p in params):
            raise ValueError(f"every parameter must be stacked along a first dimension of {n}")
        self.instances = n
        super().__init__(params, {k: _per_instance(v, n, k) for k, v in defaults.items()})


class StackedSGD(_Stacked):
    """SGD with momentum, dampening 0, no Nesterov: per instance, `lr`, `momentum` and
    `weight_decay` may be lists."""

    def __init__(self, params, lr: float | Sequence[float], momentum=0.0, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            decay, uses_momentum = bool(group["weight_decay"].any()), bool(group["momentum"].any())
            for p in group["params"]:
                if p.grad is None:
                    continue
                # in place wherever torch's SGD is: a temporary of an embedding table's
                # size costs as much as the step
                grad = p.grad.add(_along(group["weight_decay"], p) * p) if decay else p.grad
                if uses_momentum:
                    momentum = _along(group["momentum"], p)
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    # torch's first step copies the gradient into the buffer
                    buf = grad.clone() if buf is None else buf.mul_(momentum).add_(grad)
                    state["momentum_buffer"] = buf
                    if bool((group["momentum"] == 0).any()):  # those instances: plain SGD
                        grad = torch.where(momentum != 0, buf, grad)
                    else:
                        grad = buf
                p.addcmul_(grad, _along(group["lr"], p), value=-1)
        return loss


class StackedAdam(_Stacked):
    """Adam (not AdamW, no amsgrad): per instance, `lr`, `betas` (two lists), `eps` and
    `weight_decay` may be lists."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                beta1, beta2 = group["beta1"], group["beta2"]
                grad = p.grad
                if bool(group["weight_decay"].any()):
                    grad = grad.add(_along(group["weight_decay"], p) * p)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, _along(1 - beta1, p))
                exp_avg_sq.mul_(_along(beta2, p)).addcmul_(grad, grad * _along(1 - beta2, p))
                bias1 = 1 - beta1 ** t
                bias2_sqrt = (1 - beta2 ** t).sqrt()
                denom = exp_avg_sq.sqrt().div_(_along(bias2_sqrt, p)).add_(_along(group["eps"], p))
                p.addcdiv_(exp_avg.mul(_along(-group["lr"] / bias1, p)), denom)
        return loss
