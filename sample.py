"""
Sample text from a trained checkpoint, streamed to stdout as it is generated. The command line
only: the run is loaded by harness/load.py, decoded and turned into text by decode.py.

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

import decode
from harness.common import UserError, cli
from harness.device import device_memory, pick_device
from harness.flags import check_seed, configure
from harness.load import describe, load_run

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
length_temperature = -1.0  # -1 keeps the checkpoint's; t >= 0: queries past the context x 1 + t ln
tokenizer = ""          # "" uses the path recorded in the checkpoint; either way its sha256 must match
# -----------------------------------------------------------------------------------------


# Decode steps after which compiling the per-token step has paid for its compile time, by
# device type: below it, --compile=auto stays eager because compiling costs more than it saves.
# The figure, its measurement and command are docs/SPEED.md's "Decoding" section (against a
# cold compile); a device type it has not measured has no entry, and auto leaves it eager.
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
             "rope_factor", "length_temperature", "tokenizer")
    cfg = configure({k: globals()[k] for k in names}, argv, sources=(__file__,))
    try:
        decode.check_sampling(cfg["temperature"], cfg["top_k"] or None, cfg["top_p"])
    except ValueError as e:
        raise UserError(e) from None
    if cfg["num_samples"] < 1 or cfg["max_new_tokens"] < 1:
        raise UserError("num_samples and max_new_tokens must be >= 1")
    check_seed(cfg["seed"])
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


def check_memory(model, n_prompt, cfg, device):
    """Refuse, before the batch is built, --num_samples that cannot decode in this device's
    memory: the samples are one batch, so the cache (keys and values of every layer over the
    window; none without use_cache) and the prefill's logits and scores grow with it. Only the
    clearly impossible is refused (as train.py's own check)."""
    c, memory = model.config, device_memory(device)
    n = min(n_prompt + cfg["max_new_tokens"], c.context_window if cfg["use_cache"] else
            c.block_size)  # the positions one forward holds: the cache, or the cropped window
    # the widest forward: the prefill with the cache, every step of the uncached loop
    chunk = min(n_prompt, n) if cfg["use_cache"] else n
    size = next(model.parameters()).element_size()
    per_sample = size * (2 * c.n_layer * n * c.n_embd * cfg["use_cache"] +
                         chunk * (c.vocab_size + 8 * c.n_embd))
    per_sample += 4 * c.n_head * chunk * n * (c.attention == "softmax")
    need = cfg["num_samples"] * per_sample
    if memory is not None and need > memory:
        raise UserError(f"--num_samples={cfg['num_samples']} needs about "
                        f"{need / 2 ** 30:,.1f} GiB to decode as one "
                        f"batch, more than the {memory / 2 ** 30:,.1f} GiB here: ask for fewer "
                        f"samples (or a shorter prompt and max_new_tokens)")


def stream_samples(model, sp, prompt_ids, cfg, device, compiled):
    """Generate cfg["num_samples"] samples as one batch; the first is printed as it comes.
    Returns (the samples' TextStreams, decode steps run, time of the first token, end time)."""
    num_samples, eos, out = cfg["num_samples"], sp.eos_id(), sys.stdout
    prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)[None].repeat(num_samples, 1)
    rng = torch.Generator(device=device).manual_seed(cfg["seed"])
    streams = [decode.TextStream(sp) for _ in range(num_samples)]
    for s in streams:
        s.push(prompt_ids)
    out.write(streams[0].text)
    out.flush()
    finished = [False] * num_samples
    steps, t_first = 0, None
    try:
        for next_tokens in decode.generate_stream(model, prompt, cfg["max_new_tokens"],
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
    model, sp, ckpt = load_run(cfg["out_dir"], device, cfg["dtype"], cfg["tokenizer"], *(
        cfg[k] for k in ("rope_scaling", "rope_factor", "length_temperature")))  # overrides
    print(describe(cfg["out_dir"], ckpt, model), file=sys.stderr)
    prompt_ids = encode_prompt(sp, prompt_text)
    check_memory(model, len(prompt_ids), cfg, device)
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
