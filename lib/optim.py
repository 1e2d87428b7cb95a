"""
optimizer=muon (imported only then): torch.optim.Muon for the hidden matrices, paired with
lib/checkpoint.py's AdamW for the rest. Every parameter group carries "base_lr", its peak rate
(learning_rate, or muon_lr): train.py sets each group's lr to that times the schedule's
fraction, so Muon's groups follow the same warmup and decay.
"""
import torch

from lib.checkpoint import adamw


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
    if name == "adamw":
        return adamw(model, learning_rate, weight_decay, betas, device_type)
    if not hasattr(torch.optim, "Muon"):
        raise ValueError(f"optimizer=muon needs torch >= 2.9 (torch.optim.Muon); this is "
                         f"torch {torch.__version__}")
    hidden = [m.weight for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)]
    # Muon's default lr adjustment ("original": rate x sqrt(max(1, rows/cols))) keeps the
    # update's RMS alike across matrix shapes at one muon_lr; its decoupled weight decay
    # shrinks by muon_lr x weight_decay per step, as AdamW's does by lr x weight_decay.
    muon = torch.optim.Muon([p for p in hidden if p.requires_grad], lr=muon_lr,
                            weight_decay=weight_decay, momentum=muon_momentum)
    muon.param_groups[0]["base_lr"] = muon_lr
    return MuonAdamW(muon, adamw(model, learning_rate, weight_decay, betas, device_type,
                                 exclude={id(p) for p in hidden}))
