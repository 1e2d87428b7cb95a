"""
Sample text from a trained checkpoint, streamed to stdout as it is generated; and the decoding
every script uses (eval.py, bench/ and the tests import it from here): prefill the prompt into
the cache, then one token per step against it (eager, or one static compiled graph), a sliding
window past the context window, and sampling.

    python sample.py --out_dir=out-small
    python sample.py --out_dir=out-small --start="def main(" --num_samples=4 --max_new_tokens=200
    python sample.py --out_dir=out-small --start=FILE:prompt.txt --temperature=0
    python sample.py --out_dir=out-small --rope_scaling=ntk --rope_factor=4 --max_new_tokens=2000

    from sample import generate
    out = generate(model, idx, max_new_tokens=100, temperature=0.8, top_k=200)

Text goes to stdout, everything else (checkpoint summary, speed) to stderr, so
`python sample.py ... > out.txt` keeps only the text. Same override style as train.py:
module-level defaults below, then config files, then --key=value.
"""
import os
import sys
import time

import torch

from lib import run_tokenizer
from lib.checkpoint import misfit, read, rescale
from lib.common import UserError, cli, configure, pick_device
from model import RecurrentState, RoFormer, RoFormerConfig

# -----------------------------------------------------------------------------------------
# loading a run (also for eval.py and export.py)

def load_run(out_dir, device, dtype, tokenizer="", rope_scaling="", rope_factor=0.0):
    """out_dir -> (model in eval mode on `device` in `dtype`, sentencepiece processor, the
    checkpoint dict). rope_scaling / rope_factor ("" / 0: keep the checkpoint's) change the
    rotation at inference, which needs no retraining."""
    if not out_dir:
        raise UserError("out_dir is empty: pass the run's folder, --out_dir=DIR")
    if not os.path.isdir(out_dir):
        raise UserError(f"out_dir {out_dir!r} does not exist (train first, or pass --out_dir=DIR)")
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isfile(ckpt_path):
        raise UserError(f"no checkpoint at {ckpt_path}")
    ckpt = read(ckpt_path)
    try:
        config = RoFormerConfig(**ckpt["model_args"])
    except (TypeError, ValueError) as e:
        raise UserError(f"model config in {ckpt_path}: {e}") from None
    if rope_scaling or rope_factor:  # the checkpoint's config is valid: a refusal is the flags'
        args = rescale(ckpt["model_args"], rope_scaling, rope_factor)
        try:
            config = RoFormerConfig(**args)
        except ValueError as e:
            flags = {"rope_scaling": rope_scaling, "rope_factor": rope_factor}
            flags = " ".join(f"--{k}={v}" for k, v in flags.items() if v)
            raise UserError(f"{flags} does not fit this model: {e}") from None
    model = RoFormer(config)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # weights of another shape or another model file
        raise UserError(misfit(ckpt_path, e)) from None
    model.eval().to(device=device, dtype=getattr(torch, dtype))
    sp = run_tokenizer.load(run_tokenizer.find(out_dir, ckpt.get("tokenizer"), tokenizer))
    if sp.get_piece_size() > model.config.vocab_size:
        raise UserError(f"tokenizer has {sp.get_piece_size()} pieces, the model only "
                        f"{model.config.vocab_size}")
    return model, sp, ckpt


def dataset_dir(ckpt, gone_ok=False):
    """The folder of the run's dataset (val.bin, meta.json), for eval.py --split and export.py's
    check. A run records the folder it read (config data_dir, an absolute path): that folder, or
    a UserError saying it is gone (None with gone_ok); never another corpus. Older checkpoints
    hold the --data_dir given ("" or relative: no record) and keep the old search: that
    data_dir, the tokenizer's folder, data/<dataset> (None when none is there). Either way a
    folder whose tokenizer.model is not the run's is refused: its val.bin holds another
    vocabulary's ids."""
    info = ckpt.get("tokenizer") or {}
    recorded = (ckpt.get("config") or {}).get("data_dir")
    recorded = recorded if recorded and os.path.isabs(recorded) else None
    candidates = [recorded] if recorded else [info.get("data_dir")] + [
        os.path.dirname(p) for p in run_tokenizer.recorded_places(info)]
    found = [d for d in candidates
             if d and all(os.path.isfile(os.path.join(d, f)) for f in ("val.bin", "meta.json"))]
    for d in found:
        if not info.get("sha256") or tokenizer_sha256(d) == info["sha256"]:
            return d  # (a run without tokenizer.model has nothing to check)
    if found:
        what = "missing" if tokenizer_sha256(found[0]) is None else "another"
        raise UserError(f"{found[0]} is not the dataset this run read: its tokenizer.model is "
                        f"{what} (the run's has sha256 {info['sha256'][:12]}...): prepared "
                        f"again since, or another corpus")
    if recorded and not gone_ok:
        raise UserError(f"the run read its data from {recorded}, which is gone (no val.bin and "
                        f"meta.json there)")
    return None


def tokenizer_sha256(folder):
    return run_tokenizer.sha256(os.path.join(folder, run_tokenizer.NAME))


def describe(out_dir, ckpt, model):
    """One line about the loaded run, for stderr."""
    c, p = model.config, next(model.parameters())
    dtype = str(p.dtype).removeprefix("torch.")
    return (f"{os.path.join(out_dir, 'ckpt.pt')}: iter {ckpt.get('iter_num')}, val loss "
            f"{ckpt.get('best_val_loss', float('nan')):.4f}, {model.num_params() / 1e6:.2f}M "
            f"params, {c.attention} attention, {c.pos_encoding} positions, rope_scaling "
            f"{c.rope_scaling} x{c.rope_factor:g}, window {c.context_window} (original context "
            f"{c.original_context}); {p.device} {dtype}")


# -----------------------------------------------------------------------------------------
# decoding

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
    bs = model.config.block_size
    # the last sampled token is never fed back, so its position needs no embedding
    if use_cache and model.config.pos_encoding == "learned" and \
            idx.size(1) + max_new_tokens - 1 > bs:
        raise ValueError(f"learned positions end at block_size={bs}; a {idx.size(1)}-token "
                         f"prompt and {max_new_tokens} new tokens need use_cache=False")


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
    cache preallocated), with CUDA graphs on CUDA."""
    if not compile:
        return lambda tok, pos: model(tok, cache=cache, start_pos=pos)[0][:, -1]
    cuda = torch.device(device).type == "cuda"
    if cuda:  # CUDA graphs replay fixed addresses: the caches are written in place
        held = [t for pair in cache.state for t in pair] if isinstance(cache, RecurrentState) \
            else [cache.slot_pos] + cache.keys + cache.values
        for t in held:
            torch._dynamo.mark_static_address(t)
    forward = torch.compile(model.forward, fullgraph=True, dynamic=False,
                            mode="reduce-overhead" if cuda else None)

    def step(tok, pos):
        if cuda:  # a new replay: the last step's logits (already sampled from) may go
            torch.compiler.cudagraph_mark_step_begin()
        return forward(tok, cache=cache, start_pos=pos)[0][:, -1]
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
            model.slide_tables(idx.size(1) + i)
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


# -----------------------------------------------------------------------------------------
# the command line
# -----------------------------------------------------------------------------------------
out_dir = "out"
start = "\n"            # the prompt; "FILE:path" reads it from a file; "" starts a fresh document
num_samples = 1         # generated together as one batch; the first streams live
max_new_tokens = 500
temperature = 0.8       # 0 is greedy
top_k = 200             # 0: off
top_p = 1.0             # 1.0: off
seed = 1337
device = "auto"         # auto: cuda if available, else cpu
dtype = "auto"          # auto: bfloat16 on a CUDA GPU that supports it (else float16), float32 on CPU
use_cache = True        # False: the reference loop that recomputes the last block_size tokens per step
compile = "auto"        # compile the per-token decode step: True | False | auto (on only where it
                        # was measured to pay for its compile time at this length; see below)
stop_at_eos = True      # a sample ends when the model closes its document
rope_scaling = ""       # "" keeps the checkpoint's; "none" | "linear" | "ntk" | "yarn" override it
rope_factor = 0.0       # 0 keeps the checkpoint's; else the window is original context * factor
tokenizer = ""          # "" uses the path recorded in the checkpoint; either way its sha256 must match
# -----------------------------------------------------------------------------------------


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


# Decode steps after which compiling the per-token step has paid for its compile time, by
# device type: below it, --compile=auto stays eager because compiling costs more than it saves.
# Measured with bench/decode.py (the figures and the command are in docs/). CUDA has no entry
# (nothing measured there yet), so auto leaves it eager.
COMPILE_PAYS_AFTER = {"cpu": 100_000}


def compile_pays(choice, device, new_tokens):
    """--compile: True/False as given; auto: on where measured to pay at this length."""
    choice = str(choice).lower()
    if choice != "auto":
        return choice == "true"
    return new_tokens >= COMPILE_PAYS_AFTER.get(device.type, float("inf"))


def parse_args(argv):
    """The settings, checked before anything loads: a typo should not wait for a checkpoint."""
    names = ("out_dir", "start", "num_samples", "max_new_tokens", "temperature", "top_k", "top_p",
             "seed", "device", "dtype", "use_cache", "compile", "stop_at_eos", "rope_scaling",
             "rope_factor", "tokenizer")
    cfg = configure({k: globals()[k] for k in names}, argv)
    try:
        check_sampling(cfg["temperature"], cfg["top_k"] or None, cfg["top_p"])
    except ValueError as e:
        raise UserError(e) from None
    if cfg["num_samples"] < 1 or cfg["max_new_tokens"] < 1:
        raise UserError("num_samples and max_new_tokens must be >= 1")
    if not 0 <= cfg["seed"] < 2 ** 64:  # what torch.Generator.manual_seed takes
        raise UserError(f"seed must be in [0, 2**64 - 1], got {cfg['seed']}")
    if str(cfg["compile"]).lower() not in ("auto", "true", "false"):
        raise UserError(f"compile must be True, False or auto, got {cfg['compile']!r}")
    if str(cfg["compile"]).lower() == "true" and not cfg["use_cache"]:
        raise UserError("--compile=True compiles the cached decode step; drop --use_cache=False")
    return cfg


def read_prompt(start_arg):
    """--start as given, or the file named after FILE: exactly as it is on disk (newline=""
    keeps CRLF: training keeps "\\r" too, so the prompt is the text the model was trained on)."""
    if not start_arg.startswith("FILE:"):
        return start_arg
    path = start_arg[len("FILE:"):]
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the prompt file {path}: {e}")


def encode_prompt(sp, prompt_text):
    """Prompt text -> token ids; an empty prompt starts a new document."""
    ids = sp.encode(prompt_text)
    if sp.unk_id() in ids:  # byte fallback off (or no byte piece): refuse to guess
        unencodable = sorted({ch for ch in prompt_text if sp.unk_id() in sp.encode(ch)})
        raise UserError(f"the tokenizer cannot encode these prompt characters: "
                        f"{''.join(unencodable)!r}")
    if not ids:
        # Every training document follows an end-of-document token, so that is the honest
        # "start of a document" context; BOS never occurs in the training data.
        eos, bos = sp.eos_id(), sp.bos_id()
        ids = [eos] if eos >= 0 else [bos] if bos >= 0 else sp.encode("\n")
        print(f"note: empty prompt; starting a new document from "
              f"{sp.id_to_piece(ids[0])!r}", file=sys.stderr)
    return ids


def stream_samples(model, sp, prompt_ids, cfg, device, compiled):
    """Generate cfg["num_samples"] samples as one batch; the first is printed as it comes.
    Returns (the samples' TextStreams, decode steps run, time of the first token, end time)."""
    num_samples, eos, out = cfg["num_samples"], sp.eos_id(), sys.stdout
    prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)[None].repeat(num_samples, 1)
    rng = torch.Generator(device=device).manual_seed(cfg["seed"])
    streams = [TextStream(sp) for _ in range(num_samples)]
    for s in streams:
        s.push(prompt_ids)
    out.write(streams[0].text)
    out.flush()
    finished = [False] * num_samples
    steps, t_first = 0, None
    try:
        for next_tokens in generate_stream(model, prompt, cfg["max_new_tokens"],
                                                    temperature=cfg["temperature"],
                                                    top_k=cfg["top_k"] or None,
                                                    top_p=cfg["top_p"],
                                                    use_cache=cfg["use_cache"], generator=rng,
                                                    compile=compiled,
                                                    vocab_limit=sp.get_piece_size()):
            for b, token in enumerate(next_tokens[:, 0].tolist()):  # .tolist() waits for the device
                if finished[b]:
                    continue
                if cfg["stop_at_eos"] and token == eos:
                    finished[b] = True
                    continue
                text = streams[b].push([token])
                if b == 0 and text:
                    out.write(text)
                    out.flush()
            steps += 1
            t_first = t_first or time.perf_counter()
            if all(finished):
                break
    except ValueError as e:  # e.g. learned positions asked to run past their table
        raise UserError(e) from None
    return streams, steps, t_first, time.perf_counter()


def print_samples(streams):
    """The rest of the first sample (it streamed live), then the others in full."""
    for b, s in enumerate(streams):
        rest = s.flush()
        sys.stdout.write(rest + "\n" if b == 0 else "---------------\n" + s.text + "\n")
    sys.stdout.flush()


def speed_line(n_prompt, num_samples, steps, t0, t_first, t_end, use_cache, compiled):
    """One line for stderr: prompt and decode throughput."""
    prompt_s = t_first - t0
    line = f"prompt: {n_prompt} tokens x {num_samples} in {prompt_s * 1e3:.1f} ms " \
           f"({n_prompt * num_samples / prompt_s:.0f} tok/s, incl. the first sample)"
    if steps > 1:
        line += f"; decode: {steps - 1} steps x {num_samples} in {t_end - t_first:.2f} s " \
                f"({(steps - 1) * num_samples / (t_end - t_first):.1f} tok/s)"
    return line + f"; cache {'on' if use_cache else 'off'}, " \
                  f"compile {'on (compiling is in the decode time)' if compiled else 'off'}"


@cli
def main(argv):
    cfg = parse_args(argv)
    device, cfg["dtype"] = pick_device(cfg["device"], cfg["dtype"])
    prompt_text = read_prompt(cfg["start"])
    model, sp, ckpt = load_run(cfg["out_dir"], device, cfg["dtype"], cfg["tokenizer"],
                               cfg["rope_scaling"], cfg["rope_factor"])
    print(describe(cfg["out_dir"], ckpt, model), file=sys.stderr)
    prompt_ids = encode_prompt(sp, prompt_text)
    compiled = compile_pays(cfg["compile"], device, cfg["max_new_tokens"]) and cfg["use_cache"]
    t0 = time.perf_counter()
    streams, steps, t_first, t_end = stream_samples(model, sp, prompt_ids, cfg, device, compiled)
    print_samples(streams)
    print(speed_line(len(prompt_ids), cfg["num_samples"], steps, t0, t_first, t_end,
                     cfg["use_cache"], compiled), file=sys.stderr)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except BrokenPipeError:
        # The reader went away (`| head`): stop generating, and point stdout at /dev/null so
        # the interpreter's final flush does not print a second BrokenPipeError.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
