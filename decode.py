"""
Decoding, for sample.py, bench/ and the tests: prefill the prompt into the cache, then
one token per step against it (eager, or one static compiled graph), a sliding window past the
context window, sampling, and the tokens streamed as text (TextStream).

    from decode import generate
    out = generate(model, idx, max_new_tokens=100, temperature=0.8, top_k=200)
"""
import sys

import torch

from caches import RecurrentState
from model_checks import positions_error


def check_sampling(temperature=1.0, top_k=None, top_p=None, vocab_limit=None):
    """Raise ValueError (one line) for sampling settings that cannot work."""
    if vocab_limit is not None and vocab_limit < 1:
        raise ValueError(f"vocab_limit must be >= 1 (None: every id), got {vocab_limit}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 or None: off), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 or None: off), got {top_p}")


# Temperatures in (0, GREEDY_BELOW) decode greedily: float32 logits / 1e-45 overflow (NaN
# probabilities), and at 1e-6 only tokens within float32 rounding of the top one have any
# probability left, so greedy is that distribution up to rounding, and its limit at 0.
GREEDY_BELOW = 1e-6


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None,
                vocab_limit=None):
    """(B, V) logits -> (B, 1) tokens. temperature 0 is greedy; top_k keeps the k likeliest
    tokens; top_p keeps the smallest set whose probability reaches p. vocab_limit: only ids
    below it are ever drawn (a model whose vocab_size was padded past its tokenizer's pieces
    has rows no piece decodes)."""
    if vocab_limit is not None:  # ids are a prefix, so the slice keeps every id as it is
        logits = logits[:, :vocab_limit]
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before this token already >= p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


def check_request(model, idx, max_new_tokens, use_cache, compile):
    """Raise ValueError (one line) for a generate call that cannot run on this model."""
    if idx.size(1) == 0:
        raise ValueError("generate needs at least one prompt token")
    if compile and not use_cache:
        raise ValueError("compile=True compiles the cached decode step; it needs use_cache=True")
    # the last sampled token is never fed back, so its position needs no embedding
    why = use_cache and positions_error(model.config, idx.size(1) + max_new_tokens - 1)
    if why:
        raise ValueError(f"{why}; a {idx.size(1)}-token prompt and {max_new_tokens} new tokens "
                         f"need use_cache=False")


def prefill(model, idx, cache, chunk):
    """Run the prompt into the cache in chunks of `chunk` tokens (the cache size), so a long
    prompt costs memory linear in its length; return the last position's (B, V) logits."""
    for start in range(0, idx.size(1), chunk):
        logits = model(idx[:, start:start + chunk], cache=cache, start_pos=start)[0]
    return logits[:, -1]


def one_token_step(model, cache, compile, device):
    """The function called per token once the prefill has allocated every cache tensor:
    (B, 1) tokens and a (1,) position tensor -> (B, V) logits. Eager, the model's forward;
    compiled, the same forward traced once into a static graph (the position is data, the
    cache preallocated), its host code CUDA graphs on CUDA, C++ on a Linux CPU."""
    if not compile:
        return lambda tok, pos: model(tok, cache=cache, start_pos=pos)[0][:, -1]
    kind = torch.device(device).type
    cuda = kind == "cuda"
    if cuda:  # CUDA graphs replay fixed addresses: the caches are written in place
        held = [t for pair in cache.state for t in pair] if isinstance(cache, RecurrentState) \
            else [cache.slot_pos] + cache.keys + cache.values
        for t in held:
            torch._dynamo.mark_static_address(t)
    # the host code that calls the kernels: CUDA graphs on CUDA; C++ on a Linux CPU, where a
    # batch-1 step is many small kernel calls, each cheaper from C++ (docs/SPEED.md#decoding;
    # torch's own tests leave the C++ host code out on macOS, so there it stays Python)
    how = {"cuda": {"mode": "reduce-overhead"}}
    if sys.platform == "linux":
        how["cpu"] = {"options": {"cpp_wrapper": True}}
    forward = torch.compile(model.forward, fullgraph=True, dynamic=False, **how.get(kind, {}))
    warm = False

    def step(tok, pos):
        nonlocal warm
        if cuda:  # a new replay: the last step's logits (already sampled from) may go
            torch.compiler.cudagraph_mark_step_begin()
        # The first call checks every guard (compiling, or choosing this model's graph); after
        # it each call passes this cache and a token and position of the same shapes, so only
        # the guards that tell compiled graphs apart run (docs/SPEED.md, "Guards checked ...")
        with torch.compiler.set_stance(skip_guard_eval_unsafe=warm):
            logits = forward(tok, cache=cache, start_pos=pos)[0][:, -1]
        warm = True
        return logits
    return step


@torch.no_grad()
def cached_tokens(model, idx, max_new_tokens, sampling, generator, compile):
    """Prefill, then one cached step per token; the position stays on the device, so the
    host never waits for a step to finish."""
    total = idx.size(1) + max_new_tokens
    cache = model.new_cache(total, idx.device)
    logits = prefill(model, idx, cache, min(total, model.config.context_window))
    step = one_token_step(model, cache, compile, idx.device)
    pos = torch.full((1,), idx.size(1), dtype=torch.long, device=idx.device)
    for i in range(max_new_tokens):
        token = sample_next(logits, **sampling, generator=generator)
        yield token
        if i + 1 < max_new_tokens:
            # the step reads table rows by position: their memory must not grow with
            # max_new_tokens (the cache rolls, the positions do not), so the rows slide along
            model.hold_positions(idx.size(1) + i, 1)
            logits = step(token, pos)
            pos += 1


@torch.no_grad()
def uncached_tokens(model, idx, max_new_tokens, sampling, generator):
    """The reference loop (nanoGPT's): each step reruns the model from scratch on the last
    context_window tokens."""
    seq, window = idx, model.config.context_window
    for _ in range(max_new_tokens):
        token = sample_next(model(seq[:, -window:])[0][:, -1], **sampling, generator=generator)
        yield token
        seq = torch.cat((seq, token), dim=1)


def generate_stream(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                    use_cache=True, generator=None, compile=False, vocab_limit=None):
    """Yield the next (B, 1) tokens one at a time (arguments checked now, not at the first
    token). use_cache=True: prefill, then one token per step against the cache (a rolling
    window of context_window keys, or linear attention's state); False: the reference loop,
    recomputing the last context_window tokens per step. compile=True (cached only): the step
    as one static graph, sampling outside it (eager and compiled draw the same tokens when
    their logits agree). vocab_limit: never draw an id >= it (a vocab padded past the
    tokenizer's pieces)."""
    check_sampling(temperature, top_k, top_p, vocab_limit)
    check_request(model, idx, max_new_tokens, use_cache, compile)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, vocab_limit=vocab_limit)
    if use_cache:
        return cached_tokens(model, idx, max_new_tokens, sampling, generator, compile)
    return uncached_tokens(model, idx, max_new_tokens, sampling, generator)


def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
             use_cache=True, generator=None, compile=False, vocab_limit=None):
    """Return idx followed by max_new_tokens sampled tokens, (B, T + new)."""
    new = list(generate_stream(model, idx, max_new_tokens, temperature, top_k, top_p,
                               use_cache, generator, compile, vocab_limit))
    return torch.cat([idx] + new, dim=1)


class TextStream:
    """Token ids in, printable text out, so that the concatenation of everything returned
    equals sp.decode(all ids).

    Decoding token by token is wrong twice over: a character outside the vocabulary arrives
    as several byte tokens (each alone decodes to U+FFFD), and sentencepiece drops the space
    of a word-initial piece at the start of a decode. So we decode a short window that starts
    one emission back: the window's first piece is already printed, and only the text past it
    is new. If the window ends in U+FFFD (a character still incomplete), we wait for more."""

    def __init__(self, sp):
        self.sp, self.ids, self.text = sp, [], ""
        self.start = self.read = 0  # window start; end of the ids already printed

    def push(self, ids):
        self.ids.extend(ids)
        old = self.sp.decode(self.ids[self.start:self.read])
        new = self.sp.decode(self.ids[self.start:])
        if len(new) <= len(old) or new.endswith("\ufffd") or not new.startswith(old):
            return ""
        self.start, self.read = self.read, len(self.ids)
        self.text += new[len(old):]
        return new[len(old):]

    def flush(self):
        """What is still held back (invalid bytes that will never complete)."""
        full = self.sp.decode(self.ids)
        rest = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += rest
        return rest
