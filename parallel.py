"""
How train.py spreads a model over processes: DDP or FSDP2 wrapping, the meta-device build, the
gradient sync and clipping, and the state dicts a sharded model's checkpoint needs (checkpoint.py
writes and reads the files). Plain functions over torch's own APIs.

DDP (the default): every rank holds the whole model, its gradients and the AdamW state, and
all-reduces the gradients. FSDP2 (fsdp=True): every rank holds 1/N of each; a block's weights
are all-gathered just before it runs and freed after, its gradients reduce-scattered.
"""
import contextlib
import ctypes
import functools
import inspect
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from model import RoFormer, init_parameter


def init_process_group(device_type, rank, world):
    """Join torchrun's process group (nccl on GPUs, gloo on CPUs). The rendezvous is done by
    hand to prefix the store's keys with the restart count: after a `torchrun --max-restarts`
    restart, the agent's store still holds the dead workers' addresses, and gloo would
    sometimes connect to them (refused, or hung) instead of the new ones."""
    store, _, _ = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)
    dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo", store=store,
                            rank=rank, world_size=world)


def stop_with_launcher():
    """Under torchrun, ask Linux to SIGTERM this worker when its launcher dies. torchrun starts
    each worker in a session of its own, so a kill -9 of torchrun (or of its process group) used
    to leave the workers training on their own. The SIGTERM handler then finishes the step,
    saves and exits, as for any SIGTERM. The signal comes when the thread that started the
    worker ends; torchrun starts its workers from its main thread. Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    if ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the launcher died before the request: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


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
        # No buffer sync before every forward: the only buffers are the position tables, built
        # identically on every rank. Newer torch names it forward_sync_buffers (and warns on
        # every rank about broadcast_buffers); older ones only know broadcast_buffers.
        ddp_args = inspect.signature(nn.parallel.DistributedDataParallel).parameters
        no_sync = {"forward_sync_buffers" if "forward_sync_buffers" in ddp_args
                   else "broadcast_buffers": False}
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[torch.device(device).index] if device.startswith("cuda") else None,
            **no_sync)
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
# state dicts for checkpoint.py (which does the files): as laid out now, sharded or not

def is_sharded(model):
    return isinstance(model, FSDPModule)


def sharded_state(raw_model, optimizer):
    """Model and optimizer state as this rank holds it (DTensor shards with FSDP), the form
    DCP saves and loads in place. It also creates the optimizer's state, which DCP needs to
    exist before it can load into it."""
    msd, osd = get_state_dict(raw_model, optimizer)
    return {"model": msd, "optimizer": osd}


def set_sharded_state(raw_model, optimizer, state):
    set_state_dict(raw_model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def full_weights(raw_model):
    """The consolidated weights of a sharded model, gathered to rank 0's CPU one parameter at
    a time (a collective: every rank calls it)."""
    return get_model_state_dict(raw_model,
                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(raw_model, optimizer, weights, optim_state):
    """Load a one-process or DDP run's full state into raw_model and optimizer, cut into this
    rank's shards if the model is sharded."""
    if not is_sharded(raw_model):
        raw_model.load_state_dict(weights)
        optimizer.load_state_dict(optim_state)
        return
    # The file's optimizer state is keyed by position in the parameter groups; name the
    # entries by parameter instead, the form the distributed loader understands.
    names = {id(p): n for n, p in raw_model.named_parameters()}
    fqn = {i: names[id(p)] for saved, cur in zip(optim_state["param_groups"],
                                                 optimizer.param_groups)
           for i, p in zip(saved["params"], cur["params"])}
    osd = {"state": {fqn[i]: v for i, v in optim_state["state"].items()},
           "param_groups": [dict(g, params=[fqn[i] for i in g["params"]])
                            for g in optim_state["param_groups"]]}
    set_state_dict(raw_model, optimizer, model_state_dict=weights, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True))
