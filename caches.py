"""The decoding caches, one entry per layer: a softmax layer's keys and values (KVCache), a
linear layer's recurrent state (RecurrentState). new_cache (RoFormer.new_cache) makes one,
decode.py passes it to each forward, and each layer updates its own entry with one call.
Beside model.py, imports torch only."""
import torch


def new_cache(model, total_len, device, window=None):
    """The cache a decode of total_len positions needs; window: how far back a query sees
    (None: the context window). A local layer keeps only its own window's keys."""
    c, w = model.config, window or model.config.context_window
    windows = {i: b.attn.window or w for i, b in enumerate(model.blocks)}  # 0: global, all w
    return (RecurrentState(c.n_layer) if c.attention == "linear" else
            KVCache(c.n_layer, min(total_len, w), w, device, windows))


class KVCache:
    """Per layer the keys and values of `size` positions in preallocated slots used as a ring
    (position p in slot p % size), and each slot's position (-1: empty). Past the window:
    sliding-window attention (not crop-and-recompute: deeper keys saw older tokens). local:
    {layer: its attention window}, layers that keep (and see) only min(size, window) slots."""

    def __init__(self, n_layer, size, window, device, local=None):
        self.keys, self.values = [None] * n_layer, [None] * n_layer  # (B, H, size, D) each
        self.slot_pos = torch.full((n_layer, size), -1, dtype=torch.long, device=device)
        self.window = window
        self.windows = [min(window, (local or {}).get(i, window)) for i in range(n_layer)]

    def visible(self, distance, key_pos, window=None):  # (queries, keys): causal, in the window
        return (key_pos >= 0) & (distance >= 0) & (distance < (window or self.window))

    def update(self, layer, k, v, pos):
        """Store one layer's new keys and values (positions pos) -> the keys, values, their
        positions and the (queries, keys) visibility that the layer's queries attend with."""
        empty, window = self.keys[layer] is None, self.windows[layer]
        slot_pos = self.slot_pos[layer, :window]  # a view: a local layer's first slots
        if empty:  # allocated by the first forward: its batch and dtype
            shape = (k.size(0), k.size(1), slot_pos.numel(), k.size(3))
            self.keys[layer], self.values[layer] = k.new_zeros(shape), v.new_zeros(shape)
        keys, values = self.keys[layer], self.values[layer]
        size, new = slot_pos.numel(), pos.numel()
        kept = pos[-size:]  # of a chunk longer than the cache, only the last `size` stay
        slots = kept % size
        # Write first only when nothing a query needs is evicted: one token, or a chunk that
        # fits an empty cache (known on the host: no read-back); else the queries attend to
        # the old slots and the whole chunk side by side.
        if new == 1 or (empty and new <= size):
            key_pos, seen = slot_pos, (keys, values)  # aliases: read after the writes below
        else:
            key_pos, seen = torch.cat((slot_pos, pos)), (torch.cat((keys, k), 2),
                                                         torch.cat((values, v), 2))
        slot_pos[slots] = kept
        keys[:, :, slots], values[:, :, slots] = k[:, :, -size:], v[:, :, -size:]
        return *seen, key_pos, self.visible(pos[:, None] - key_pos[None, :], key_pos, window)


class RecurrentState:
    """Per layer eq. 19's running (S, z), float32, constant in size; it never forgets."""

    def __init__(self, n_layer):
        self.state = [None] * n_layer

    def update(self, layer, S, z):  # in place: a compiled (CUDA-graph) step replays addresses
        old = self.state[layer]
        self.state[layer] = (S, z) if old is None else (old[0].copy_(S), old[1].copy_(z))
