"""
Sample text from a trained checkpoint, streamed to stdout as it is generated.

    python sample.py --out_dir=out-small
    python sample.py --out_dir=out-small --start="def main(" --num_samples=4 --max_new_tokens=200
    python sample.py --out_dir=out-small --start=FILE:prompt.txt --temperature=0
    python sample.py --out_dir=out-small --rope_scaling=ntk --rope_factor=4 --max_new_tokens=2000

Text goes to stdout, everything else (checkpoint summary, speed) to stderr, so
`python sample.py ... > out.txt` keeps only the text. Same override style as train.py:
module-level defaults below, then config files, then --key=value.
"""
import os
import sys
import time

import torch

from checkpoint import describe, load_run, pick_device
from configurator import ConfigError, configure
from generate import generate_stream

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
rope_scaling = ""       # "" keeps the checkpoint's; "none" | "linear" | "ntk" override it (RoPE only)
rope_factor = 0.0       # 0 keeps the checkpoint's; else how many times block_size to cover
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


# Decode steps after which compiling the step has paid for its compile time, by device type
# (bench/decode.py table 1, "compile pays after"; see the README). CPU, 6 layers x 384: the
# compiled step saved 0.3-1.5 ms per token against 9-12 s of compiling with a warm inductor
# cache (27-34 s cold): 5,000-56,000 tokens warm, up to ~100,000 cold. No GPU was available to
# measure, so auto leaves CUDA eager.
COMPILE_PAYS_AFTER = {"cpu": 100_000}


def compile_pays(choice, device, new_tokens):
    """--compile: True/False as given; auto: on where measured to pay at this length."""
    choice = str(choice).lower()
    if choice != "auto":
        return choice == "true"
    return new_tokens >= COMPILE_PAYS_AFTER.get(device.type, float("inf"))


def main(argv):
    names = ("out_dir", "start", "num_samples", "max_new_tokens", "temperature", "top_k", "top_p",
             "seed", "device", "dtype", "use_cache", "compile", "stop_at_eos", "rope_scaling",
             "rope_factor", "tokenizer")
    try:
        cfg = configure({k: globals()[k] for k in names}, argv)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    # argument checks first: a typo should not wait for a checkpoint to load
    if cfg["temperature"] < 0:
        sys.exit(f"error: temperature must be >= 0 (0 is greedy), got {cfg['temperature']}")
    if cfg["top_k"] < 0:
        sys.exit(f"error: top_k must be >= 0 (0 turns it off), got {cfg['top_k']}")
    if not 0.0 < cfg["top_p"] <= 1.0:
        sys.exit(f"error: top_p must be in (0, 1] (1 turns it off), got {cfg['top_p']}")
    if cfg["num_samples"] < 1 or cfg["max_new_tokens"] < 1:
        sys.exit("error: num_samples and max_new_tokens must be >= 1")
    if str(cfg["compile"]).lower() not in ("auto", "true", "false"):
        sys.exit(f"error: compile must be True, False or auto, got {cfg['compile']!r}")
    if str(cfg["compile"]).lower() == "true" and not cfg["use_cache"]:
        sys.exit("error: --compile=True compiles the cached decode step; drop --use_cache=False")
    dev, cfg["dtype"] = pick_device(cfg["device"], cfg["dtype"])
    start_text = cfg["start"]
    if start_text.startswith("FILE:"):
        try:
            with open(start_text[5:], encoding="utf-8") as f:
                start_text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            sys.exit(f"error: cannot read the prompt file {start_text[5:]}: {e}")

    # --- checkpoint, model and tokenizer -----------------------------------------------
    model, sp, ckpt = load_run(cfg["out_dir"], dev, cfg["dtype"], cfg["tokenizer"],
                               cfg["rope_scaling"], cfg["rope_factor"])
    print(describe(cfg["out_dir"], ckpt, model), file=sys.stderr)

    # --- prompt --------------------------------------------------------------------------
    ids = sp.encode(start_text)
    if sp.unk_id() in ids:  # byte fallback off (or no byte piece): refuse to guess
        bad = sorted({ch for ch in start_text if sp.unk_id() in sp.encode(ch)})
        sys.exit(f"error: the tokenizer cannot encode these prompt characters: {''.join(bad)!r}")
    eos = sp.eos_id()
    if not ids:
        # Every training document follows an end-of-document token, so that is the honest
        # "start of a document" context; BOS never occurs in the training data.
        ids = [eos] if eos >= 0 else [sp.bos_id()] if sp.bos_id() >= 0 else sp.encode("\n")
        print(f"note: empty prompt; starting a new document from "
              f"{sp.id_to_piece(ids[0])!r}", file=sys.stderr)
    B = cfg["num_samples"]
    x = torch.tensor(ids, dtype=torch.long, device=dev)[None].repeat(B, 1)
    gen = torch.Generator(device=dev).manual_seed(cfg["seed"])
    compiled = compile_pays(cfg["compile"], dev, cfg["max_new_tokens"]) and cfg["use_cache"]

    # --- generate ------------------------------------------------------------------------
    streams = [TextStream(sp) for _ in range(B)]
    for s in streams:
        s.push(ids)
    out = sys.stdout
    out.write(streams[0].text)
    out.flush()
    done = [False] * B
    steps, t0 = 0, time.perf_counter()
    t_first = None
    try:
        for nxt in generate_stream(model, x, cfg["max_new_tokens"], cfg["temperature"],
                                   cfg["top_k"] or None, cfg["top_p"], cfg["use_cache"],
                                   gen, compiled):
            for b, t in enumerate(nxt[:, 0].tolist()):  # .tolist() waits for the device
                if done[b]:
                    continue
                if cfg["stop_at_eos"] and t == eos:
                    done[b] = True
                    continue
                text = streams[b].push([t])
                if b == 0 and text:
                    out.write(text)
                    out.flush()
            steps += 1
            if t_first is None:
                t_first = time.perf_counter()
            if all(done):
                break
    except ValueError as e:  # e.g. learned positions asked to run past their table
        sys.exit(f"error: {e}")
    t_end = time.perf_counter()
    for b, s in enumerate(streams):
        rest = s.flush()
        if b == 0:
            out.write(rest + "\n")
        else:
            out.write("---------------\n" + s.text + "\n")
    out.flush()
    prompt_s = t_first - t0
    line = f"prompt: {len(ids)} tokens x {B} in {prompt_s * 1e3:.1f} ms " \
           f"({len(ids) * B / prompt_s:.0f} tok/s, incl. the first sample)"
    if steps > 1:
        line += f"; decode: {steps - 1} steps x {B} in {t_end - t_first:.2f} s " \
                f"({(steps - 1) * B / (t_end - t_first):.1f} tok/s)"
    print(line + f"; cache {'on' if cfg['use_cache'] else 'off'}, "
                 f"compile {'on (compiling is in the decode time)' if compiled else 'off'}",
          file=sys.stderr)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except BrokenPipeError:
        # The reader went away (`| head`): stop generating, and point stdout at /dev/null so
        # the interpreter's final flush does not print a second BrokenPipeError.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except KeyboardInterrupt:
        sys.exit(130)
