"""
Configuration shared by train.py, sample.py and the bench scripts, in the style nanoGPT users
know: a script's module-level defaults, then config files (plain Python that assigns
variables), then --key=value overrides, applied in that order.

    python train.py config/small.py --batch_size=32 --compile=False

Every mistake stops with one line that names the key: an unknown key (with the nearest valid
one), a value of the wrong type, a missing config file. Also here: file_sha256, the
tokenizer identity that train.py records and sample.py checks, and the facts about the
hardware that the scripts' `auto` choices and MFU rest on.
"""
import ast
import difflib
import hashlib
import os

SCALARS = (bool, int, float, str, type(None))


class ConfigError(ValueError):
    pass


def _unknown(key, known):
    near = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _coerce(key, value, default):
    """Check `value` against the type of the default; ints are accepted where floats are."""
    if not isinstance(value, SCALARS):  # a tuple or list would otherwise pass unnoticed
        raise ConfigError(f"config key '{key}' takes a single {type(default).__name__} value, "
                          f"got {value!r} ({type(value).__name__})")
    if default is None:
        return value
    want = type(default)
    if want is float and type(value) is int:
        return float(value)
    if type(value) is not want:
        raise ConfigError(f"config key '{key}' must be {want.__name__} (default {default!r}), "
                          f"got {value!r} ({type(value).__name__})")
    return value


def _parse(key, text, default):
    """The text after '='. For a string key it is the value itself, exactly as typed:
    a quoted docstring keeps its quotes, --start=42 and --start=None are text. Otherwise it
    is read as a Python literal (true/false are accepted for booleans)."""
    if isinstance(default, str):
        return text
    if isinstance(default, bool) and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if default is None:
            return text
        raise ConfigError(f"config key '{key}': cannot read {text!r} as a "
                          f"{type(default).__name__}") from None


def configure(defaults, argv):
    """Return a copy of `defaults` (name -> scalar) updated by the config files and
    --key=value arguments in `argv`. Raises ConfigError with a one-line message."""
    config = dict(defaults)
    known = sorted(defaults)
    for arg in argv:
        if not arg.startswith("--"):  # a config file
            if not os.path.isfile(arg):
                raise ConfigError(f"config file not found: {arg}")
            scope = {}
            with open(arg) as f:
                exec(compile(f.read(), arg, "exec"), scope)
            for key, value in scope.items():
                if key.startswith("_") or (key not in defaults and not isinstance(value, SCALARS)):
                    continue  # __builtins__, imported modules, helper functions
                if key not in defaults:
                    raise ConfigError(f"{arg}: {_unknown(key, known)}")
                try:
                    config[key] = _coerce(key, value, defaults[key])
                except ConfigError as e:
                    raise ConfigError(f"{arg}: {e}") from None
            continue
        key, eq, text = arg[2:].partition("=")
        if key not in defaults:
            raise _unknown(key, known)
        if not eq:  # a bare --flag sets a boolean
            if not isinstance(defaults[key], bool):
                raise ConfigError(f"config key '{key}' needs a value: --{key}=...")
            config[key] = True
            continue
        config[key] = _coerce(key, _parse(key, text, defaults[key]), defaults[key])
    return config


def file_sha256(path):
    """The identity of a tokenizer file: train.py records it in the checkpoint, sample.py
    checks it, so a retrained tokenizer never silently turns ids into the wrong text."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------
# hardware facts behind dtype=auto and MFU

def cpu_has_bf16():
    """True where the CPU multiplies bf16 natively (AVX512-BF16 or AMX): there bf16 autocast is
    several times faster than fp32; elsewhere it is emulated and slower."""
    import torch
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:  # not Linux: be conservative
        return False
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and torch.backends.mkldnn.is_available()


def cuda_autocast_dtype():
    """"bfloat16" where the GPU computes bf16 natively (Ampere and later), else "float16" (with
    a GradScaler when training). torch counts emulated bf16 as supported unless asked not to,
    and on a T4 or V100 emulation is several times slower than fp16."""
    import torch
    try:
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # an older torch without the argument counted native support only
        native = torch.cuda.is_bf16_supported()
    return "bfloat16" if native else "float16"


# Dense (no sparsity) bf16/fp16 tensor-core peak of one card, from the vendors' datasheets. The
# variants of one family differ a lot (H100 SXM vs PCIe, A10 vs A10G, L40 vs L40S), so names
# are matched by whole words; an unknown card gets no MFU rather than a wrong one.
GPU_PEAK_FLOPS = {
    ("h200",): 989e12, ("h200", "nvl"): 835e12,
    ("h100",): 989e12, ("h100", "pcie"): 756e12, ("h100", "nvl"): 835e12,
    ("a100",): 312e12, ("a30",): 165e12, ("a10",): 125e12,
    ("l4",): 121e12, ("l40",): 181e12, ("l40s",): 362e12,
    ("v100",): 125e12, ("v100", "pcie"): 112e12, ("t4",): 65e12,
}


def gpu_peak_flops(name):
    """Peak FLOP/s of one card from its torch.cuda.get_device_name(), or None if unknown.
    "NVIDIA H100 80GB HBM3" is the SXM part; PCIe and NVL parts say so in their names."""
    words = set(name.lower().replace("-", " ").split())
    best = None
    for key, flops in GPU_PEAK_FLOPS.items():
        if key[0] in words and all(w in words for w in key[1:]):
            if best is None or len(key) > len(best[0]):  # the most specific match wins
                best = (key, flops)
    return best[1] if best else None
