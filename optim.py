"""
The optimizer train.py steps (and the benches and tests build): AdamW with weight decay on the
matrices only.

Every parameter group carries "lr_scale": the training loop sets each group's lr to the
schedule's value times that scale, so groups with their own base learning rate follow the same
warmup and decay.
"""
import torch


def build_optimizer(model, learning_rate, weight_decay=0.0, betas=(0.9, 0.95), device_type="cpu",
                    name="adamw"):
    """AdamW; weight decay on matrices (linears, embeddings) only, not on norms/biases."""
    if name != "adamw":
        raise ValueError(f"optimizer must be 'adamw', got {name!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")
    for g in opt.param_groups:
        g["lr_scale"] = 1.0
    return opt
