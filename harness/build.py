"""The model built the same way for one process, DDP and FSDP (train.py, bench/speed/fsdp.py): on
the meta device, wrapped, then given memory and initialised from the seed."""
import functools

import torch

from model import RoFormer, init_parameter


def build_model(mconf, seed, device, fsdp=False, ddp=False, param_dtype=None, compile=False,
                activation_checkpointing=False):
    """Returns (raw_model, model, eval_model): the RoFormer itself (state dicts, optimizer),
    the module to train (compiled, DDP- or FSDP-wrapped) and the one to evaluate. The model is
    built on the meta device (shapes only), sharded by FSDP if asked, and only then given
    memory on `device` and initialised from `seed`: with FSDP no rank ever holds more than its
    shard plus one full parameter, and every mode starts from the same weights."""
    with torch.device("meta"):
        model = RoFormer(mconf)
    if activation_checkpointing:
        # Keep only each block's input for backward and recompute the rest: the forward runs
        # twice, the activation memory drops to one block's. The module is not wrapped, so
        # parameter names (and checkpoints) stay the same.
        from torch.utils.checkpoint import checkpoint
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    if fsdp or ddp:  # only under torchrun: one process needs no torch.distributed
        from harness import parallel
    if fsdp:
        parallel.fully_shard_model(model, device, param_dtype, compile)
    materialise(model, device)
    init_weights(model, seed)
    if fsdp:  # every rank runs the evaluation too: a sharded forward is a collective
        return model, model, model
    wrapped = eval_model = torch.compile(model) if compile else model  # rank 0 evaluates alone
    if ddp:
        wrapped = parallel.ddp_wrap(wrapped, device)
    return model, wrapped, eval_model


def materialise(model, device):
    """Give a meta-built model uninitialised memory on `device`. to_empty loses two things
    that are put back here: ties between parameters (on a plain module wte and lm_head would
    come apart; FSDP keeps them) and buffers computed at construction (the position tables,
    which model.py builds on the CPU even under the meta device)."""
    owners, buffers = {}, []
    for mname, mod in model.named_modules():
        for name, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, name))
        for name, b in mod._buffers.items():
            if b is not None and b.is_meta and b.numel():
                raise RuntimeError(f"buffer {mname}.{name} was built on the meta device: nothing "
                                   f"would give it its values after to_empty")
            if b is not None and not b.is_meta:
                buffers.append((mod, name, b))
    model.to_empty(device=device)
    for shared in owners.values():
        first = getattr(*shared[0])
        for mod, name in shared[1:]:
            if getattr(mod, name) is not first:
                setattr(mod, name, first)
    for mod, name, b in buffers:
        setattr(mod, name, b.to(device))


@torch.no_grad()
def init_weights(model, seed):
    """model.init_parameter (the one rule: each parameter from its own (seed, name) stream, as
    RoFormer(cfg, seed) draws it), so that it does not depend on the sharding: each full
    parameter drawn on every rank, each rank keeping its own shard of it (sharded random ops
    would give every number of ranks other weights)."""
    for name, p in model.named_parameters():  # the tied head is wte's weight: drawn once
        full = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        init_parameter(name, full, model.config.n_layer, seed)
        if hasattr(p, "device_mesh"):  # a DTensor: this rank's piece, cut locally
            from torch.distributed.tensor import distribute_tensor
            full = distribute_tensor(full, p.device_mesh, p.placements,
                                     src_data_rank=None).to_local()
            p = p.to_local()
        p.copy_(full)
