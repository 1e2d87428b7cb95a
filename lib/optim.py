"""
optimizer=muon (imported only then): Muon for the hidden matrices, paired with
lib/checkpoint.py's AdamW for the rest. Every parameter group carries "base_lr", its peak rate
(learning_rate, or muon_lr): train.py sets each group's lr to that times the schedule's
fraction, so Muon's groups follow the same warmup and decay.
"""
import math

import torch

from lib.common import UserError, native_bf16


class Muon(torch.optim.Optimizer):
    """Muon: SGD momentum (Nesterov), then each matrix's update orthogonalised by a quintic
    Newton-Schulz iteration. torch.optim.Muon's update, hyperparameters and state_dict (so its
    checkpoints load here), with one change: the iteration runs in `ns_dtype`. torch's always
    runs it in bfloat16, which a CPU without native bf16 emulates ~100x slower than float32:
    there the optimizer step cost several times the whole forward and backward."""

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
    agree to the bit (tests/test_optim.py)."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


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


def adamw(model, learning_rate, weight_decay=0.0, betas=(0.9, 0.95), device_type="cpu",
          exclude=()):
    """AdamW with weight decay on matrices (linears, embeddings) only, not on norms or biases;
    parameters in `exclude` (ids) are left to another optimizer (lib/optim.py's Muon). Every
    group carries "base_lr", its peak rate: train.py sets lr to that times the schedule."""
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in exclude]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused: one kernel over all parameters on CUDA and on CPU (the default there is a Python
    # loop over the parameters, which a small model's step feels; docs/OPTIM.md)
    opt = torch.optim.AdamW(groups, lr=learning_rate, betas=betas,
                            fused=True if device_type in ("cuda", "cpu") else None)
    for g in opt.param_groups:
        g["base_lr"] = learning_rate
    return opt


def check(name, fsdp=False):
    """The optimizer's own refusals, before anything is built (train.py, build_optimizer)."""
    if name not in ("adamw", "muon"):
        raise UserError(f"optimizer must be 'adamw' or 'muon', got {name!r}")
    if fsdp and name == "muon":
        raise UserError("optimizer=muon does not work with fsdp=True: FSDP's sharded (DTensor) "
                        "optimizer state is supported for AdamW only; use DDP or optimizer=adamw")


def training_dtype(name, dtype, asked):
    """The dtype to train in: Muon takes float32 where dtype=auto picked float16 (GPUs without
    bf16), and refuses a float16 that was asked for."""
    if name == "muon" and dtype == "float16":
        if asked != "auto":
            raise UserError("optimizer=muon does not work with dtype=float16 (the GradScaler "
                            "steps one torch optimizer, not Muon paired with AdamW): use "
                            "bfloat16 or float32")
        return "float32"
    return dtype


def build_optimizer(model, learning_rate, weight_decay=0.0, betas=(0.9, 0.95), device_type="cpu",
                    name="adamw", muon_lr=0.02, muon_momentum=0.95, fsdp=False):
    """AdamW; weight decay on matrices (linears, embeddings) only, not on norms/biases.
    name="muon": the weights of the Linear layers inside the blocks (attention and MLP) go to
    Muon at base rate muon_lr instead; embeddings (token, position and relative-position
    tables), the tied head, norms and biases stay with AdamW, as Muon's authors advise:
    orthogonalising an update suits a hidden layer's map, not a lookup table or a gain. Muon
    orthogonalises in bfloat16 where `device_type` multiplies it natively, else in float32."""
    check(name, fsdp)
    if name == "adamw":
        return adamw(model, learning_rate, weight_decay, betas, device_type)
    hidden = [m.weight for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)]
    # Muon's decoupled weight decay shrinks by muon_lr x weight_decay per step, as AdamW's
    # does by lr x weight_decay.
    ns_dtype = torch.bfloat16 if native_bf16(device_type) else torch.float32
    muon = Muon([p for p in hidden if p.requires_grad], lr=muon_lr, weight_decay=weight_decay,
                momentum=muon_momentum, ns_dtype=ns_dtype)
    muon.param_groups[0]["base_lr"] = muon_lr
    return MuonAdamW(muon, adamw(model, learning_rate, weight_decay, betas, device_type,
                                 exclude={id(p) for p in hidden}))
