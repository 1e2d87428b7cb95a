"""Your own corpus: text files and folders, .jsonl / .jsonl.gz, .parquet (mixed freely)
-> data/<out_dir>/{train,val}.bin, tokenizer.model, meta.json.

    python data/text/prepare.py --input notes/ book.txt --out_dir mytext --vocab_size 8000
    python data/text/prepare.py --input shards/ --out_dir web --val_tokens 5000000
    python data/text/prepare.py --input shards/ --out_dir /big/web   # train.py --data_dir=/big/web

The kind of a file comes from its name: .jsonl(.gz) records and .parquet rows hold a document
in --text_field; any other file is UTF-8 text and one document, and a corpus of a single text
file is split at blank lines. The inputs and --out_dir in detail: docs/DATA.md.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from data import pipeline  # noqa: E402
from data.sources import file_sources, find_files  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or folders")
    p.add_argument("--out_dir", default="text", help=f"default: data/text; {pipeline.OUT_DIR_HELP}")
    p.add_argument("--ext", nargs="*", default=None, metavar="EXT",
                   help="only files in folders whose names end so (e.g. .py .jsonl.gz); "
                        "default: all")
    p.add_argument("--text_field", default="text",
                   help="the JSON field / parquet column that holds a document; several names, "
                        "comma-separated (text,content): the first one a record has")
    p.add_argument("--model_type", choices=["bpe", "unigram", "char"], help="default bpe")
    p.add_argument("--undecodable", default="fail", choices=["fail", "skip"],
                   help="a text file that is not UTF-8, or a JSON/parquet record without a "
                        "string --text_field, stops the run (fail) or is left out (skip); a "
                        "file none of whose records has the field stops it either way")
    pipeline.add_arguments(p, vocab_size=None)
    args = p.parse_args(argv)

    def body(_):
        sources = file_sources(find_files(args.input, args.ext))
        options = pipeline.prepare_options(args)
        if options["vocab_size"] is None:  # 0: sized by the characters seen
            options["vocab_size"] = 0 if args.model_type == "char" else 4096
        out_dir = pipeline.resolve_out_dir(args.out_dir)
        return pipeline.prepare(out_dir, os.path.basename(out_dir), sources,
                                " ".join(os.path.abspath(x) for x in args.input),
                                text_field=args.text_field, undecodable=args.undecodable, **options)
    return pipeline.run(body, argv)


if __name__ == "__main__":
    main()
