"""The default corpus: this Python's own standard library (.py sources) and the documentation
text CPython ships in pydoc_data.topics. Every Python install has it, so training needs no
download. Deterministic: documents are sorted by their path relative to the stdlib folder.

    python data/pystdlib/prepare.py [--vocab_size 4096] [--out_dir pystdlib]
"""
import argparse
import os
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from data import pipeline  # noqa: E402
# Folders inside the stdlib that are not the stdlib: installed packages and bytecode caches.
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources():
    """(sources, description) for this Python: every .py file of the stdlib (a document each;
    the few that are not UTF-8 are skipped), then the pydoc topics, held in memory."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        for fn in sorted(names):
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                files.append(("stdlib/" + os.path.relpath(path, root).replace(os.sep, "/"), path))
    files.sort()  # by relative name, so the order does not depend on os.walk
    sources = [(name, "text", path) for name, path in files]
    sources.append(("pydoc_data.topics", "docs", pydoc_topics))
    version = ".".join(map(str, sys.version_info[:3]))
    source = f"Python {version} standard library at {root} (.py files) + pydoc_data.topics"
    return sources, source


def pydoc_topics():
    """The text of help('keywords'), help('if'), ... in sorted order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []  # some distributions strip it; the sources alone are plenty
    return [topics[key] for key in sorted(topics)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", default="pystdlib",
                   help=f"default: data/pystdlib; {pipeline.OUT_DIR_HELP}")
    p.add_argument("--model_type", choices=["bpe", "unigram", "char"], help="default bpe")
    pipeline.add_arguments(p)
    args = p.parse_args(argv)

    def body(_):
        sources, source = stdlib_sources()
        return pipeline.prepare(pipeline.resolve_out_dir(args.out_dir), "pystdlib", sources, source,
                                undecodable="skip", **pipeline.prepare_options(args))
    return pipeline.run(body, argv)


if __name__ == "__main__":
    main()
