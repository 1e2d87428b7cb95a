"""
The optimizer: AdamW, or Muon (muon.py, imported only for optimizer=muon) for the hidden
matrices with AdamW for the rest, and their rules. Every parameter group carries "base_lr", its
peak rate (learning_rate, or muon_lr): train.py sets each group's lr to that times the
schedule's fraction, so Muon's groups follow the same warmup and decay.
"""
import torch


def adamw(model, learning_rate, weight_decay=0.0, betas=(0.9, 0.95), device_type="cpu",
          exclude=()):
    """AdamW with weight decay on matrices (linears, embeddings) only, not on norms or biases;
    parameters in `exclude` (ids) are left to another optimizer (muon.py's Muon). Every
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
    """The optimizer's own refusals, before anything is built (harness/start.py, which makes
    them one-line errors, and build_optimizer): ValueError, as model.py's."""
    if name not in ("adamw", "muon"):
        raise ValueError(f"optimizer must be 'adamw' or 'muon', got {name!r}")
    if fsdp and name == "muon":
        raise ValueError("optimizer=muon does not work with fsdp=True: FSDP's sharded (DTensor) "
                        "optimizer state is supported for AdamW only; use DDP or optimizer=adamw")


def training_dtype(name, dtype, asked):
    """The dtype to train in: Muon takes float32 where dtype=auto picked float16 (GPUs without
    bf16), and refuses a float16 that was asked for."""
    if name == "muon" and dtype == "float16":
        if asked != "auto":
            raise ValueError("optimizer=muon does not work with dtype=float16 (the GradScaler "
                            "steps one torch optimizer, not Muon paired with AdamW): use "
                            "bfloat16 or float32")
        return "float32"
    return dtype


def build_optimizer(model, learning_rate, weight_decay=0.0, betas=(0.9, 0.95), device_type="cpu",
                    name="adamw", muon_lr=0.02, muon_momentum=0.95, fsdp=False, bf16=False):
    """AdamW; weight decay on matrices (linears, embeddings) only, not on norms/biases.
    name="muon": the weights of the Linear layers inside the blocks (attention and MLP) go to
    Muon at base rate muon_lr instead; embeddings (token, position and relative-position
    tables), the output head (tied or not: it lies outside the blocks), norms and biases stay
    with AdamW, as Muon's authors advise: orthogonalising an update suits a hidden layer's map,
    not a lookup table, the vocabulary classifier or a gain. Muon orthogonalises in bfloat16
    where `bf16` says the device multiplies it natively (harness/device.native_bf16), else in
    float32."""
    check(name, fsdp)
    if name == "adamw":
        return adamw(model, learning_rate, weight_decay, betas, device_type)
    from muon import Muon, MuonAdamW  # only for optimizer=muon
    hidden = [m.weight for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)]
    # Muon's decoupled weight decay shrinks by muon_lr x weight_decay per step, as AdamW's
    # does by lr x weight_decay.
    ns_dtype = torch.bfloat16 if bf16 else torch.float32
    muon = Muon([p for p in hidden if p.requires_grad], lr=muon_lr, weight_decay=weight_decay,
                momentum=muon_momentum, ns_dtype=ns_dtype)
    muon.param_groups[0]["base_lr"] = muon_lr
    return MuonAdamW(muon, adamw(model, learning_rate, weight_decay, betas, device_type,
                                 exclude={id(p) for p in hidden}))
