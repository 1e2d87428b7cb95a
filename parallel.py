"""
How train.py spreads a model over processes and how it saves and loads it: DDP or FSDP2
wrapping, and both checkpoint formats. Plain functions over torch's own APIs.

DDP (the default): every rank holds the whole model, its gradients and the AdamW state, and
all-reduces the gradients. FSDP2 (fsdp=True): every rank holds 1/N of each; a block's weights
are all-gathered just before it runs and freed after, its gradients reduce-scattered.

Checkpoints. out_dir/ckpt.pt always exists and always holds the full model weights with the
run's metadata, so sample.py, eval.py and export.py read any run's out_dir the same way. A DDP
or one-process run also keeps the optimizer in it. An FSDP run keeps model and optimizer in a
DCP folder beside it instead (every rank writes its own shards, nobody gathers the optimizer)
and ckpt.pt names that folder. ckpt.pt is replaced last, atomically: it is the commit point,
so a crash at any moment leaves the previous ckpt.pt and the folder it names intact.
"""
import contextlib
import functools
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from model import RoFormer, init_parameter


def build_model(mconf, seed, device, fsdp=False, ddp=False, param_dtype=None, compile=False,
                activation_checkpointing=False):
    """Returns (raw_model, model, eval_model): the RoFormer itself (state dicts, optimizer),
    the module to train (compiled, DDP- or FSDP-wrapped) and the one to evaluate.

    The model is built on the meta device (shapes only), sharded if fsdp, and only then
    given memory on `device` and initialised, so with FSDP no rank ever holds more than its
    shard plus one full parameter. The same path serves every mode, so one process, DDP and
    FSDP start from the same weights."""
    with torch.device("meta"):
        raw = RoFormer(mconf)
    if activation_checkpointing:
        # Keep only each block's input for backward and recompute the rest: the forward runs
        # twice, the activation memory drops to one block's. The module is not wrapped, so
        # parameter names (and checkpoints) stay the same.
        for block in raw.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    if fsdp:
        mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
        # bf16 compute with fp32 sharded weights and fp32 gradient reduction (this replaces
        # autocast). cast_forward_inputs=False: the blocks get the RoPE tables as inputs,
        # and those must stay float32 (bf16 angles are badly rounded).
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
        for block in raw.blocks:  # one all-gather per block, overlapped with compute
            if compile:
                block.compile()  # in place: parameter names keep no _orig_mod. prefix
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(raw, mesh=mesh, mp_policy=mp)  # the rest: embeddings (tied head), ln_f
    materialise(raw, device)
    init_weights(raw, seed)
    if fsdp:  # every rank runs the evaluation too: a sharded forward is a collective
        return raw, raw, raw
    model = torch.compile(raw) if compile else raw
    eval_model = model  # never the DDP wrapper: rank 0 evaluates alone, with no collectives
    if ddp:
        # broadcast_buffers=False: the only buffers are the position tables, built identically
        # on every rank, so re-sending them from rank 0 before every forward would be waste.
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[torch.device(device).index] if device.startswith("cuda") else None,
            broadcast_buffers=False)
    return raw, model, eval_model


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
    """RoFormer's initialisation (model.init_parameter, the one rule), drawn so that it does
    not depend on the sharding: each full parameter is drawn in turn from one generator seeded
    with `seed` on every rank, and each rank keeps its own shard of it. (Sharded random ops
    would give every shard a stream of its own: other weights for every number of ranks.)"""
    gen = None
    for name, p in model.named_parameters():  # the tied head is wte's weight: drawn once
        full = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        init_parameter(name, full, model.config.n_layer, gen)
        if isinstance(p, DTensor):  # this rank's piece, cut locally (src_data_rank=None)
            full = distribute_tensor(full, p.device_mesh, p.placements,
                                     src_data_rank=None).to_local()
            p = p.to_local()
        p.copy_(full)


def grad_sync(model, last):
    """The context of one micro-step's backward. DDP all-reduces gradients on the last
    micro-step only. FSDP reduce-scatters on every one: skipping would keep full, unsharded
    gradients on every rank until the last, the very memory FSDP is there to save."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def clip_grad_norm(model, max_norm):
    """Clip to the global gradient norm (0: no clipping) and return that norm, a 0-d tensor.
    With FSDP each rank holds a shard of each gradient; clip_grad_norm_ on the sharded
    (DTensor) gradients all-reduces the squares, so norm and clipping are the whole model's."""
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


# ----------------------------------------------------------------------------------------
# checkpoints

def is_sharded(model):
    return isinstance(model, FSDPModule)


def save_checkpoint(path, meta, raw_model, optimizer):
    """Write the checkpoint `path` (out_dir/ckpt.pt): `meta` (iteration, RNG, config, ...)
    plus the full model weights, and the optimizer (in the file, or in a DCP folder for an
    FSDP model). Every rank must call this: with FSDP it is a collective."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    ck = dict(meta)
    if is_sharded(raw_model):
        out_dir = os.path.dirname(path)
        # A fresh folder name, even when re-saving the same iteration: the folder that the
        # current ckpt.pt names must survive until the new ckpt.pt replaces it.
        name = [None]
        if rank0:
            k = 0
            while any(os.path.exists(os.path.join(out_dir, f"ckpt-{meta['iter_num']}.{k}.dcp{s}"))
                      for s in ("", ".tmp")):
                k += 1
            name = [f"ckpt-{meta['iter_num']}.{k}.dcp"]
        dist.broadcast_object_list(name, src=0)
        name = name[0]
        msd, osd = get_state_dict(raw_model, optimizer)
        dcp.save({"model": msd, "optimizer": osd},
                 checkpoint_id=os.path.join(out_dir, name + ".tmp"))
        # The consolidated weights, gathered to rank 0's CPU one parameter at a time.
        ck["model"] = get_model_state_dict(
            raw_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        ck["sharded"] = name
        if rank0:
            # dcp.save returns on rank 0 after every rank has written its files
            os.replace(os.path.join(out_dir, name + ".tmp"), os.path.join(out_dir, name))
            commit(path, ck)
        dist.barrier()  # everyone returns with the checkpoint committed
    elif rank0:
        ck["model"] = raw_model.state_dict()  # the uncompiled module: no _orig_mod. prefixes
        ck["optimizer"] = optimizer.state_dict()
        commit(path, ck)


def commit(path, ck):
    """Write ckpt.pt atomically (temp file, then rename over), then delete the DCP folder that
    the replaced ckpt.pt named, if it names another one, and what crashed saves left."""
    old = None
    if os.path.exists(path):
        try:
            old = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("sharded")
        except Exception:  # an unreadable old file names nothing we could trust
            pass
    torch.save(ck, path + ".tmp")
    os.replace(path + ".tmp", path)
    out_dir = os.path.dirname(path)
    stale = [old] if old and old != ck.get("sharded") else []
    stale += [f for f in os.listdir(out_dir) if f.endswith(".dcp.tmp")]  # crashed saves
    for f in stale:
        shutil.rmtree(os.path.join(out_dir, f), ignore_errors=True)


def load_checkpoint_state(ck, path, raw_model, optimizer):
    """Load model weights and optimizer state of the checkpoint `ck` (read from `path`) into
    raw_model and optimizer, whatever wrote it and however they are sharded now: DCP
    reshards an FSDP run's folder to any number of ranks, FSDP or not."""
    if "sharded" in ck:
        folder = os.path.join(os.path.dirname(path), ck["sharded"])
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{path} names {folder}, which does not exist")
        # get_state_dict gives the state as it is laid out now (and creates the optimizer's
        # state, which DCP needs to exist to load into); DCP fills it in place.
        msd, osd = get_state_dict(raw_model, optimizer)
        state = {"model": msd, "optimizer": osd}
        with warnings.catch_warnings():  # it warns about no_dist=True even when asked for it
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, checkpoint_id=folder, no_dist=not dist.is_initialized())
        set_state_dict(raw_model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
    elif is_sharded(raw_model):  # a DDP run's full state, cut into this rank's shards
        # The file's optimizer state is keyed by position in the parameter groups; name the
        # entries by parameter instead, the form the distributed loader understands.
        names = {id(p): n for n, p in raw_model.named_parameters()}
        saved = ck["optimizer"]
        fqn = {i: names[id(p)] for g, cur in zip(saved["param_groups"], optimizer.param_groups)
               for i, p in zip(g["params"], cur["params"])}
        osd = {"state": {fqn[i]: v for i, v in saved["state"].items()},
               "param_groups": [dict(g, params=[fqn[i] for i in g["params"]])
                                for g in saved["param_groups"]]}
        set_state_dict(raw_model, optimizer, model_state_dict=ck["model"], optim_state_dict=osd,
                       options=StateDictOptions(full_state_dict=True))
    else:
        raw_model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
