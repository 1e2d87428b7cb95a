"""The memory estimate: what one training process needs at the least (training_memory), and the
run refused before anything is allocated where that is more than the device has (check_fits)."""
import os

from harness.common import UserError
from harness.device import device_memory


def training_memory(mconf, batch_size, shards=1, checkpointing=False):
    """Bytes one training process needs at the least, roughly, in parts [(what, the keys that
    lower it, bytes)]: 16 per parameter (float32 weights and gradients, AdamW's two moments;
    FSDP shards them over `shards` ranks), one micro-batch's float32 activations (about 16
    numbers per token and channel in each layer kept for backward, 2 with activation
    checkpointing) and its logits with their gradient. The embedding and the logits are
    parts of their own: either can dwarf the rest, and only the embedding is the vocabulary's
    alone (the logits grow with batch_size x block_size as much: --block_size=100000000 at
    vocab 512 was told to lower vocab_size)."""
    d, layers, vocab = mconf.n_embd, mconf.n_layer, mconf.vocab_size
    tokens = batch_size * mconf.block_size
    per_token = (f"batch_size ({batch_size:,}; gradient_accumulation_steps keeps the tokens per "
                 f"step), block_size ({mconf.block_size:,})")
    return [("the embedding's weights and optimizer state", "vocab_size", 16 * vocab * d // shards),
            ("the layers' weights and optimizer state", "n_layer or n_embd",  # attention
             16 * 12 * layers * d * d // shards),                            # 4 d^2, MLP 8 d^2
            ("the logits and their gradient", f"{per_token} or vocab_size", 4 * tokens * 2 * vocab),
            ("the activations", f"{per_token}, n_layer or n_embd",
             4 * tokens * layers * d * (2 if checkpointing else 16))]


def check_fits(parts, dev):
    """Refuse, before anything is allocated, a run that needs more than all of the device's
    memory (the CPU's RAM shared by this machine's ranks; a GPU's total): it would only end
    in the allocator, or swap for minutes first. Only the clearly impossible is refused, with
    the largest of training_memory's `parts` and what lowers it."""
    total = device_memory(dev) if dev.type in ("cuda", "cpu") else None
    if total is None:
        return
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if dev.type == "cpu" else 1
    total //= procs
    where = f"on {dev}" if dev.type == "cuda" else "of RAM" + (
        f" per process ({procs} share this machine)" if procs > 1 else "")
    need = sum(n for _, _, n in parts)
    if need > total:
        gib = lambda n: f"{n / 2 ** 30:,.1f} GiB"  # noqa: E731
        what, keys, most = max(parts, key=lambda part: part[2])
        raise UserError(f"this model and batch need about {gib(need)} per process, more than "
                        f"the {gib(total)} {where}; {what} take {gib(most)} of it: lower {keys}")
