"""
optimizer=muon (imported only then, by optim.build_optimizer): Muon for the hidden matrices,
paired with AdamW for the rest and stepped and checkpointed with it as one optimizer.
"""
import math

import torch


class Muon(torch.optim.Optimizer):
    """Muon: SGD momentum (Nesterov), then each matrix's update orthogonalised by a quintic
    Newton-Schulz iteration. torch.optim.Muon's update, hyperparameters and state_dict (so its
    checkpoints load here), with one change: the iteration runs in `ns_dtype` (in float32, wide
    matrices in a cheaper form of it: orthogonalise). torch's always runs it in bfloat16, which
    a CPU without native bf16 emulates ~100x slower than float32: there the optimizer step cost
    several times the whole forward and backward."""

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
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = orthogonalise(update, group["ns_coefficients"], group["ns_steps"],
                                       group["eps"], self.ns_dtype)
                # the rate scaled by sqrt(rows / cols) for tall matrices (torch's "original"
                # adjustment): the update's RMS alike across shapes at one lr
                rate = group["lr"] * math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-rate)


def orthogonalise(g, coefficients, steps, eps, dtype):
    """Newton-Schulz on the wide orientation of `g` (fewer FLOPs), after scaling it to Frobenius
    norm 1 (so every singular value is <= 1): it pushes the singular values towards ~1 (0.7 to
    1.2, not exactly 1: the coefficients trade exactness for speed) and keeps the singular
    vectors. The operations are torch.optim.Muon's, in the same order, so in bfloat16 the two
    agree to the bit (tests/test_optim.py). In float32 a matrix at least twice as wide as tall
    takes the same iteration in its Gram form (gram_newton_schulz)."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    if dtype in (torch.float32, torch.float64) and steps and x.size(1) >= 2 * x.size(0):
        x = gram_newton_schulz(x, a, b, c, steps)
    else:
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def gram_newton_schulz(x, a, b, c, steps):
    """The iteration above for a wide m x n `x`, run on m x m matrices. Each step maps x to
    p(x x^T) x, p(r) = a + b r + c r^2, so every iterate is q x with q a polynomial in r = x x^T;
    all of them commute, so q and the iterate's own Gram matrix p r p can be carried instead,
    and x is multiplied once, at the end. The same map in exact arithmetic, for 4m^2 a step
    instead of 2mn + m^2 (x 2m FLOPs), plus x x^T and the last product: 38% fewer FLOPs at
    n = 4m, 26% at 3m. Only in float32 or wider: squaring the spectrum loses small singular
    values in bfloat16."""
    r, q = x @ x.T, None
    for k in range(steps):
        p = torch.addmm(r, r, r, beta=b, alpha=c)
        p.diagonal().add_(a)
        q = p if q is None else p @ q
        if k + 1 < steps:
            r = p @ r @ p
    return q @ x


class MuonAdamW:
    """Muon on the hidden matrices and torch.optim.AdamW on everything else,
    stepped, zeroed and checkpointed as one optimizer."""

    def __init__(self, muon, adamw):
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self):
        # Read afresh every time: load_state_dict replaces the group dicts, and the training
        # loop's lr writes must reach the live ones.
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
            raise ValueError("the checkpoint's optimizer state is not Muon's (a run trained with "
                             "optimizer=adamw resumes with optimizer=adamw)")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
