"""
The optimizer train.py steps (and the benches and tests build): AdamW, or Muon for the hidden
matrices with AdamW for the rest.

Every parameter group carries "base_lr", its peak rate (learning_rate, or Muon's muon_lr): the
training loop sets each group's lr to that times the schedule's fraction, so groups with their
own base learning rate (Muon's) follow the same warmup and decay.
"""
import torch


class MuonAdamW:
    """torch.optim.Muon on the hidden matrices and torch.optim.AdamW on everything else,
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


def build_optimizer(model, learning_rate, weight_decay=0.0, betas=(0.9, 0.95), device_type="cpu",
                    name="adamw", muon_lr=0.02, muon_momentum=0.95):
    """AdamW; weight decay on matrices (linears, embeddings) only, not on norms/biases.
    name="muon": the weights of the Linear layers inside the blocks (attention and MLP) go to
    torch.optim.Muon at base rate muon_lr instead; embeddings (token, position and relative-
    position tables), the tied head, norms and biases stay with AdamW, as Muon's docs advise:
    orthogonalising an update suits a hidden layer's map, not a lookup table or a gain."""
    if name not in ("adamw", "muon"):
        raise ValueError(f"optimizer must be 'adamw' or 'muon', got {name!r}")
    if name == "muon" and not hasattr(torch.optim, "Muon"):
        raise ValueError(f"optimizer=muon needs torch >= 2.9 (torch.optim.Muon); this is "
                         f"torch {torch.__version__}")
    hidden = set()
    if name == "muon":
        hidden = {id(m.weight) for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2 and id(p) not in hidden],
               "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused: one kernel over all parameters on CUDA and on CPU (the default there is a Python
    # loop over the parameters, which a small model's step feels; docs/OPTIM.md)
    fused = True if device_type in ("cuda", "cpu") else None
    adamw = torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)
    for g in adamw.param_groups:
        g["base_lr"] = learning_rate
    if name == "adamw":
        return adamw
    # Muon's default lr adjustment ("original": rate x sqrt(max(1, rows/cols))) keeps the
    # update's RMS alike across matrix shapes at one muon_lr; its decoupled weight decay
    # shrinks by muon_lr x weight_decay per step, as AdamW's does by lr x weight_decay.
    muon = torch.optim.Muon([p for p in params if id(p) in hidden], lr=muon_lr,
                            weight_decay=weight_decay, momentum=muon_momentum)
    muon.param_groups[0]["base_lr"] = muon_lr
    return MuonAdamW(muon, adamw)
