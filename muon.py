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
            shapes = {}  # the matrices of one shape are orthogonalised as one batch
            for p in group["params"]:
                if p.grad is not None:
                    shapes.setdefault(tuple(p.shape), []).append(p)
            for params in shapes.values():
                # each update is written straight into its slot of the batch (no stacking copy)
                x = params[0].grad.new_empty((len(params), *params[0].shape))
                for p, slot in zip(params, x):
                    if (buf := self.state[p].get("momentum_buffer")) is None:
                        buf = self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                    buf.lerp_(p.grad, 1 - group["momentum"])
                    if group["nesterov"]:
                        torch.lerp(p.grad, buf, group["momentum"], out=slot)
                    else:
                        slot.copy_(buf)
                x = orthogonalise_batch(x, group["ns_coefficients"], group["ns_steps"],
                                        group["eps"], self.ns_dtype)
                for p, update in zip(params, x):
                    # torch's "original" rate adjustment: the update's RMS alike across shapes
                    rate = group["lr"] * math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update, alpha=-rate)


def orthogonalise(g, coefficients, steps, eps, dtype):
    """Newton-Schulz on `g` turned wide, scaled to norm 1: singular values to 0.7-1.2, vectors
    kept; torch's operations (bit-equal in bf16), or in float32 for 2x-wide ones the Gram form."""
    return orthogonalise_batch(g[None], coefficients, steps, eps, dtype)[0]


def orthogonalise_batch(g, coefficients, steps, eps, dtype):
    """`orthogonalise` on each matrix of a batch `g` (b, rows, cols) at once: a model's 16
    hidden matrices then cost 4 chains of small products (one per shape) instead of 16, and on a
    CPU each product is a call with its own fixed cost. Each matrix is scaled by its own norm
    and multiplied alone (bmm), to the bit as one at a time. Tall ones are turned as a view,
    not copied: a float32 product rounds by memory layout, and this keeps torch's layout."""
    tall = g.size(1) > g.size(2)
    x = (g.mT if tall else g).to(dtype)
    x = x / torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=eps)
    x = newton_schulz(x, *coefficients, steps, gram_form=dtype in (
        torch.float32, torch.float64) and x.size(2) >= 2 * x.size(1))
    return x.mT if tall else x


def newton_schulz(x, a, b, c, steps, gram_form=False):
    """The iteration on a batch of wide matrices `x` (b, m, n); torch's operations per matrix."""
    if gram_form and steps:
        return gram_newton_schulz(x, a, b, c, steps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def gram_newton_schulz(x, a, b, c, steps):
    """The same map for a wide m x n `x` (or a batch of them): each iterate is q x, q a
    polynomial in x x^T, so q and the iterate's Gram matrix (p r p: all commute) are carried and
    x is multiplied once (38% fewer FLOPs at n = 4m; docs/OPTIM.md). Not in bf16: squaring the
    spectrum rounds it off."""
    if x.dim() == 2:
        return gram_newton_schulz(x[None], a, b, c, steps)[0]
    r, q = torch.bmm(x, x.mT), None
    for k in range(steps):
        p = torch.baddbmm(r, r, r, beta=b, alpha=c)
        p.diagonal(dim1=1, dim2=2).add_(a)
        q = p if q is None else torch.bmm(p, q)
        if k + 1 < steps:
            r = torch.bmm(torch.bmm(p, r), p)
    return torch.bmm(q, x)


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
