"""
How train.py spreads a model over processes under torchrun (imported only there): DDP (every
rank holds everything and all-reduces the gradients) or FSDP2 (fsdp=True: every rank holds 1/N
of the weights, gradients and AdamW state; docs/TRAINING.md) applied from outside to a model
built on the meta device, the gradient sync and clipping, and an FSDP run's checkpoint (every
rank writes its shards to a DCP folder that ckpt.pt names).
"""
import contextlib
import ctypes
import inspect
import os
import shutil
import signal
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from harness.checkpoint import commit
from harness import digest
from harness.common import UserError, excepthook
from harness.device import placed
from harness.files import fsync


def ranks(gradient_accumulation_steps):
    """(rank, local_rank, world) from torchrun's environment, once this worker is tied to its
    launcher (stop_with_launcher) and the accumulation is checked: it counts the micro-steps of
    all ranks. Every rank raises the mistake and the launcher's store lets one say it: a rank
    that left quietly at once let torchrun kill the speaker before it spoke, on a busy host."""
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    stop_with_launcher()
    steps = gradient_accumulation_steps
    if steps % world:
        raise UserError(f"gradient_accumulation_steps ({steps}) counts the micro-steps of all "
                        f"{world} processes, so it must be a multiple of {world}: pass e.g. "
                        f"--gradient_accumulation_steps={world * -(-steps // world)}")
    return rank, local_rank, world


def init_process_group(dev, rank, local_rank, world):
    """Join torchrun's process group (nccl on GPUs, gloo on CPUs), on one GPU per process
    (cuda:LOCAL_RANK unless `dev` names one); returns the device. The rendezvous is done by
    hand to prefix the store's keys with the restart count: after a `torchrun --max-restarts`
    restart, the agent's store still holds the dead workers' addresses, and gloo would
    sometimes connect to them (refused, or hung) instead of the new ones."""
    dev = placed(dev, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store, _, _ = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)
    # device_id: NCCL binds the group to this GPU (a barrier need not guess which, and warn)
    cuda = dev.type == "cuda"
    dist.init_process_group(backend="nccl" if cuda else "gloo", store=store, rank=rank,
                            world_size=world, device_id=dev if cuda else None)
    # torch's hook now prefixes every stderr line with [rankN]: a user error stays its one line
    torch_hook = sys.excepthook
    sys.excepthook = lambda kind, value, tb: (
        excepthook if issubclass(kind, UserError) else torch_hook)(kind, value, tb)
    return dev


def finish():
    """The end of a torchrun worker: nobody leaves before rank 0 has saved. Everything is
    written then, so leave without the interpreter's finalization: tearing down gloo's threads
    there (the wrapper still holds the group) sometimes aborts (SIGABRT), and torchrun would
    report a finished run as failed."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def stop_with_launcher():
    """Ask Linux to SIGTERM this worker when its launcher dies (torchrun starts each worker in a
    session of its own, so a kill -9 of torchrun left them training); the handler then saves
    and exits. Linux only: the signal comes when torchrun's main thread ends."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    if ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the launcher died before the request: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def ddp_wrap(model, device):
    """DDP around `model` (harness/build.build_model's, compiled or not)."""
    # No buffer sync before every forward: the only buffers are the position tables, built
    # identically on every rank. Newer torch names it forward_sync_buffers (and warns on
    # every rank about broadcast_buffers); older ones only know broadcast_buffers.
    ddp_args = inspect.signature(nn.parallel.DistributedDataParallel).parameters
    no_sync = {"forward_sync_buffers" if "forward_sync_buffers" in ddp_args
               else "broadcast_buffers": False}
    return nn.parallel.DistributedDataParallel(
        model, device_ids=[torch.device(device).index] if str(device).startswith("cuda")
        else None, **no_sync)


def fully_shard_model(raw, device, param_dtype=None, compile=False):
    """FSDP2 on a meta-built model: one all-gather per block, overlapped with compute; bf16
    compute with fp32 sharded weights and fp32 gradient reduction (this replaces autocast).
    cast_forward_inputs=False: the blocks get the RoPE tables as inputs, and those must stay
    float32 (bf16 angles are badly rounded)."""
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                              cast_forward_inputs=False)
    for block in raw.blocks:
        if compile:
            block.compile()  # in place: parameter names keep no _orig_mod. prefix
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(raw, mesh=mesh, mp_policy=mp)  # the rest: embeddings, the head (tied or not), ln_f


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
# an FSDP run's checkpoint: model and optimizer as each rank holds them, in a DCP folder

def is_sharded(model):
    return isinstance(model, FSDPModule)


def sharded_state(raw_model, optimizer):
    """Model and optimizer state as this rank holds it (DTensor shards with FSDP), the form
    DCP saves and loads in place. It also creates the optimizer's state, which DCP needs to
    exist before it can load into it."""
    msd, osd = get_state_dict(raw_model, optimizer)
    return {"model": msd, "optimizer": osd}


def full_weights(raw_model):
    """The consolidated weights of a sharded model, gathered to rank 0's CPU one parameter at
    a time (a collective: every rank calls it)."""
    return get_model_state_dict(raw_model,
                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_state(ckpt, path, raw_model, optimizer):
    """harness/resume.load_state's sharded half: ckpt.pt's full state cut into this rank's
    shards, or the DCP folder it names resharded to this run's ranks (FSDP or not)."""
    if "sharded" not in ckpt:
        return load_full_state(raw_model, optimizer, ckpt["model"], ckpt["optimizer"])
    folder = os.path.join(os.path.dirname(path), ckpt["sharded"])
    if not os.path.isdir(folder):
        raise UserError(f"{path} names {folder}, which does not exist")
    want = ckpt.get("sharded_digest")  # older runs: none
    if want and digest.folder_digest(folder) != want:
        raise UserError(f"cannot load {folder}: its files changed since {path} was saved "
                        f"(their sha256 is not the digest stored there: damaged on the disk or "
                        f"in a copy); restore the folder from a good copy, or train again")
    state = sharded_state(raw_model, optimizer)
    with warnings.catch_warnings():  # it warns about no_dist=True even when asked for it
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=folder, no_dist=not dist.is_initialized())
    set_state_dict(raw_model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


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


def save_sharded(path, ckpt, raw_model, optimizer):
    """An FSDP run's save, a collective: every rank writes its shards of model and optimizer to
    a fresh DCP folder, rank 0 adds the consolidated weights to ckpt.pt, which names the
    folder."""
    out_dir, rank0 = os.path.dirname(path) or ".", dist.get_rank() == 0
    # A fresh folder name, even when re-saving the same iteration: the folder that the
    # current ckpt.pt names must survive until the new ckpt.pt replaces it.
    name = [None]
    if rank0:
        k = 0
        while any(os.path.exists(os.path.join(out_dir, f"ckpt-{ckpt['iter_num']}.{k}.dcp{s}"))
                  for s in ("", ".tmp")):
            k += 1
        name = [f"ckpt-{ckpt['iter_num']}.{k}.dcp"]
    dist.broadcast_object_list(name, src=0)
    folder = os.path.join(out_dir, name[0])
    try:  # sync_files: each rank fsyncs its shard files before the folder is renamed
        dcp.save(sharded_state(raw_model, optimizer),
                 storage_writer=dcp.FileSystemWriter(folder + ".tmp", sync_files=True))
    except Exception as e:  # a full disk on any rank fails the save on every rank
        if rank0:
            shutil.rmtree(folder + ".tmp", ignore_errors=True)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot write {folder}: {msg}; the previous checkpoint, if any, "
                        f"is kept") from None
    ckpt = dict(ckpt, model=full_weights(raw_model), sharded=name[0])
    error = None
    if rank0:
        try:  # dcp.save returns on rank 0 after every rank has written its files
            ckpt["sharded_digest"] = digest.folder_digest(folder + ".tmp")  # checked on load
            os.replace(folder + ".tmp", folder)
            fsync(out_dir)
            commit(path, ckpt)
        except (OSError, UserError) as e:
            error = str(e)
    errors = [error]
    dist.broadcast_object_list(errors, src=0)  # everyone returns with the checkpoint committed
    if errors[0]:
        raise UserError(errors[0])
