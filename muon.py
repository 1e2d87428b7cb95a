"""optimizer=muon (imported then only, by optim.build_optimizer): Muon, and MuonAdamW."""
import math

import torch


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update (Nesterov momentum, then Newton-Schulz), hyperparameters and
    state_dict, but in `ns_dtype`: torch's bfloat16 is ~100x slower where a CPU emulates it."""

    COEFFICIENTS = (3.4445, -4.775, 2.0315)  # (a, b, c): x <- a x + (b G + c G^2) x, G = x x^T

    def __init__(self, params, lr, weight_decay=0.0, momentum=0.95, ns_steps=5, eps=1e-7,
                 ns_dtype=torch.bfloat16):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      nesterov=True, ns_coefficients=self.COEFFICIENTS, eps=eps,
                                      ns_steps=ns_steps, adjust_lr_fn=None))
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                if (buf := self.state[p].get("momentum_buffer")) is None:
                    buf = self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = orthogonalise(update, group["ns_coefficients"], group["ns_steps"],
                                       group["eps"], self.ns_dtype)
                # torch's "original" rate adjustment: the update's RMS alike across shapes
                rate = group["lr"] * math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-rate)


def orthogonalise(g, coefficients, steps, eps, dtype):
    """Newton-Schulz on `g` turned wide, scaled to norm 1: singular values to 0.7-1.2, vectors
    kept; torch's operations (bit-equal in bf16), or in float32 for 2x-wide ones the Gram form."""
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = (g.T if tall else g).to(dtype)
    x.div_(x.norm().clamp(min=eps))
    if dtype in (torch.float32, torch.float64) and steps and x.size(1) >= 2 * x.size(0):
        x = gram_newton_schulz(x, a, b, c, steps)
    else:
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def gram_newton_schulz(x, a, b, c, steps):
    """The same map for a wide m x n `x`: each iterate is q x, q a polynomial in x x^T, so q and
    the iterate's Gram matrix (p r p: all commute) are carried and x is multiplied once (38%
    fewer FLOPs at n = 4m; docs/OPTIM.md). Not in bf16: squaring the spectrum rounds it off."""
    r, q = x @ x.T, None
    for k in range(steps):
        p = torch.addmm(r, r, r, beta=b, alpha=c)
        p.diagonal().add_(a)
        q = p if q is None else p @ q
        if k + 1 < steps:
            r = p @ r @ p
    return q @ x


class MuonAdamW:
    """Muon on the hidden matrices, torch.optim.AdamW on the rest: stepped and saved as one."""

    def __init__(self, muon, adamw):
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self):
        # read afresh: load_state_dict replaces the group dicts, which the lr writes must reach
        return self.muon.param_groups + self.adamw.param_groups

    def step(self):
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state):
        if set(state) != {"muon", "adamw"}:
            raise ValueError("this optimizer state is not Muon's: resume with optimizer=adamw")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
