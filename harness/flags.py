"""The flags: every script's config parser, nanoGPT style: a script's module-level defaults,
then config files (plain Python that assigns variables), then --key=value; a mistake is one
line that names the key.
Also the one seed rule every script checks its --seed against. Imports of the project only
harness/common.py (UserError)."""
import ast
import difflib
import math
import os
import re
import sys
import tokenize
import traceback

from harness.common import REPO, UserError

SCALARS = (bool, int, float, str, type(None))


def unknown_key(key, known):
    near = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return UserError(f"unknown config key '{key}'{hint}")


def coerce(key, value, default):
    """`value` checked against the type of the default; ints are accepted where floats are."""
    if not isinstance(value, SCALARS):  # a tuple or list would otherwise pass unnoticed
        raise UserError(f"config key '{key}' takes a single {type(default).__name__} value, "
                        f"got {value!r} ({type(value).__name__})")
    if default is None:
        return value
    if type(default) is float and type(value) is int:
        try:
            value = float(value)
        except OverflowError:  # an int past float's range (10**400): refused below
            value = math.inf
    if type(value) is not type(default):
        raise UserError(f"config key '{key}' must be {type(default).__name__} (default "
                        f"{default!r}), got {value!r} ({type(value).__name__})")
    if type(value) is float and not math.isfinite(value):  # 1e999 reads as inf; no key takes it
        raise UserError(f"config key '{key}' must be a finite number, got {value!r}")
    return value


def parse_value(key, text, default):
    """The text after '=': for a string key exactly as typed (quotes kept, --start=42 is text);
    otherwise a Python literal (or true/false for a boolean)."""
    if isinstance(default, str):
        return text
    if isinstance(default, bool) and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if isinstance(default, float):
            try:  # inf, nan: floats, which coerce refuses as not finite (no key takes one)
                return float(text)
            except ValueError:
                pass
        if default is None:
            return text
        kind = type(default).__name__  # int, float or bool
        raise UserError(f"config key '{key}': cannot read {text!r} as "
                        f"{'an' if kind == 'int' else 'a'} {kind}") from None


def run_config_file(path):
    """The names the config file `path` assigns; an error in it names the file and line."""
    scope = {}
    try:
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), scope)
    except SyntaxError as e:
        raise UserError(f"{path}, line {e.lineno}: syntax error: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config file {path}: {e}") from None
    except Exception as e:  # raised while the file ran: the deepest line of that file
        lines = [fr.lineno for fr in traceback.extract_tb(e.__traceback__) if fr.filename == path]
        where = f", line {lines[-1]}" if lines else ""
        raise UserError(f"{path}{where}: {type(e).__name__}: {e}") from None
    return scope


def configure(defaults, argv, given=None, sources=()):
    """`defaults` (name -> scalar) updated by the config files in `argv`, in their order, then
    by its --key=value, in theirs, wherever they stand: a flag is the most specific thing a
    user says, so `--n_layer=2 one.py` runs n_layer=2 as `one.py --n_layer=2` does (a config
    file cannot read a flag, so applying it later could only undo one). The keys they set are
    added to the set `given` if one is passed: a key set to its default value is given all the
    same (train.py's init_from=RUN keeps RUN's value of a key not given). A script that passes
    `sources` (its file first, then any file that documents more of its keys) answers --help
    or -h with its usage, and exits; without them (tests/conftest.py's --model) they are keys."""
    if sources and ("--help" in argv or "-h" in argv):
        print(usage(defaults, sources))
        sys.exit(0)
    config, known = dict(defaults), sorted(defaults)
    given = set() if given is None else given
    for path in (arg for arg in argv if not arg.startswith("--")):
        for key, value in config_file_values(path, defaults, known):
            config[key] = value
            given.add(key)
    for arg in (arg for arg in argv if arg.startswith("--")):
        key, eq, text = arg[2:].partition("=")
        if key not in defaults:
            raise unknown_key(key, known)
        if not eq:  # a bare --flag sets a boolean
            if not isinstance(defaults[key], bool):
                raise UserError(f"config key '{key}' needs a value: --{key}=...")
            text = "true"
        config[key] = coerce(key, parse_value(key, text, defaults[key]), defaults[key])
        given.add(key)
    return config


def config_file_values(path, defaults, known):
    """[(key, value)] that the config file `path` sets, each checked against its default."""
    if os.path.isdir(path):  # open() would say only "Is a directory"
        files = sorted(f for f in os.listdir(path) if f.endswith(".py"))
        example = f", e.g. {os.path.join(path, files[0])}" if files else ""
        raise UserError(f"{path} is a folder, not a config file: name a file in it{example}")
    if not os.path.isfile(path):
        raise UserError(f"config file not found: {path}")
    values = []
    for key, value in run_config_file(path).items():
        if key.startswith("_") or (key not in defaults and not isinstance(value, SCALARS)):
            continue  # __builtins__, imported modules, helper functions
        try:
            if key not in defaults:
                raise unknown_key(key, known)
            values.append((key, coerce(key, value, defaults[key])))
        except UserError as e:
            raise UserError(f"{path}: {e}") from None
    return values


def key_comments(path):
    """{name: the comment beside its first assignment} in the Python file `path`, carried on
    over comment-only lines aligned under it (as sample.py's compile)."""
    with open(path, encoding="utf-8") as f:
        tokens = list(tokenize.generate_tokens(f.readline))
    comments, last = {}, None
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        before, text = tok.line[:tok.start[1]], tok.string.lstrip("#").strip()
        name = re.match(r"\s*([A-Za-z_]\w*)\s*(?::[^=]*)?=(?!=)", before)
        if name and name.group(1) not in comments:  # the first: a default, not a later use
            comments[name.group(1)], last = text, (name.group(1), tok.start)
        elif last and not before.strip() and tok.start == (last[1][0] + 1, last[1][1]):
            comments[last[0]] += " " + text  # aligned under it on the next line
            last = (last[0], tok.start)
        else:
            last = None
    return comments


def usage(defaults, sources):
    """--help's text: what the script does (the first source's docstring), every key with its
    default and its comment, and where the docs are."""
    paths = [p if os.path.isabs(p) else os.path.join(REPO, p) for p in sources]
    comments = {}
    for path in reversed(paths):  # the script's own comment wins
        comments.update(key_comments(path))
    with open(paths[0], encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    script = os.path.relpath(paths[0], REPO)
    lines = [f"usage: python {script} [config.py ...] [--key=value ...]", "", doc.strip(), "",
             "keys and their defaults (config files apply first, in order, then --key=value):"]
    width = max(len(f"{k} = {v!r}") for k, v in defaults.items())
    for key, value in defaults.items():
        text = f"{key} = {value!r}"
        lines.append(f"  {text:<{width}}  # {comments[key]}" if key in comments else f"  {text}")
    docs = sorted(f for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md"))
    lines += ["", f"docs: README.md (every script's flags); docs/: {', '.join(docs)} "
                  f"(HACKING.md maps the code)"]
    return "\n".join(line for i, line in enumerate(lines) if line or lines[i - 1])


def check_seed(seed):
    """The one seed rule (train, sample, prepare): numpy takes no negative seed, and
    torch.Generator.manual_seed and data/'s seed keys (shared.mix64) are 64-bit unsigned."""
    if not 0 <= seed < 2 ** 64:
        raise UserError(f"seed must be from 0 to 2**64 - 1, got {seed}")
