"""``ddp-exp prepare SOURCE... --out DIR``: text into a folder ``data=tokens data.path=DIR``
trains on (:mod:`ddp_exp.data.prepare_text`; docs/language-models.md).

May use: :mod:`ddp_exp.data.prepare_text`, :mod:`ddp_exp.cli.one_line_parser`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ddp_exp.cli.one_line_parser import OneLineParser
from ddp_exp.data.prepare_out import shell_override
from ddp_exp.data.prepare_text import PrepareOptions, plural, prepare, val_share_warning


def parser() -> OneLineParser:
    """The command's options."""
    p = OneLineParser(
        prog="ddp-exp prepare",
        description="Tokenize text into train.bin, val.bin, tokenizer.json and meta.json for "
                    "`python -m ddp_exp data=tokens data.path=DIR`.")
    p.add_argument("sources", nargs="*", metavar="SOURCE",
                   help="text files, folders of them, JSON lines / CSV / Parquet files")
    p.add_argument("--out", required=True, help="the folder to write (replaced atomically)")
    p.add_argument("--tokenizer", default="bpe",
                   help="bytes | bpe (trained here on the training documents) | PATH to a "
                        "tokenizer.json (default: bpe)")
    p.add_argument("--vocab-size", type=int, default=8192,
                   help="the BPE's vocabulary, the 256 bytes and <|endoftext|> included "
                        "(default: 8192)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="share of the documents held out for validation (default: 0.1)")
    p.add_argument("--seed", type=int, default=0, help="the split's seed (default: 0)")
    p.add_argument("--text-key", default="text",
                   help="the column of text in JSON lines / CSV / Parquet rows and datasets")
    p.add_argument("--documents", default="file", choices=("file", "paragraph"),
                   help="a text file is one document (file) or one per blank-line separated "
                        "paragraph (default: file)")
    p.add_argument("--dataset", default=None, metavar="NAME_OR_PATH",
                   help="a Hugging Face datasets dataset (hub name or local path)")
    p.add_argument("--split", default="train", help="the dataset's split (default: train)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str]) -> int:
    """Run ``ddp-exp prepare`` with ``argv`` (the words after ``prepare``); prints one summary
    line, whose ``data.path=`` override works pasted into a shell whatever the path holds
    (spaces, ``ü``: :func:`~ddp_exp.data.prepare_out.shell_override`), and one warning line
    when validation's share of the tokens is far from ``--val-fraction``
    (:func:`~ddp_exp.data.prepare_text.val_share_warning`). Bad input raises
    :class:`ddp_exp.config.errors.ConfigError` (the entry's one line)."""
    args = parser().parse_args(list(argv))
    opts = PrepareOptions(args.sources, args.out, args.tokenizer, args.vocab_size,
                          args.val_fraction, args.seed, args.text_key, args.documents,
                          args.dataset, args.split, progress=not args.no_progress,
                          command=["ddp-exp", "prepare", *argv])
    meta = prepare(opts)
    train, val = meta["train"], meta["val"]
    print(f"{args.out}: vocabulary {meta['vocab_size']} ({meta['dtype']}), train "
          f"{plural(train['tokens'], 'token')} / {plural(train['documents'], 'document')}, val "
          f"{plural(val['tokens'], 'token')} / {plural(val['documents'], 'document')}; train "
          f"with python -m ddp_exp experiment=gpt_tokens {shell_override('data.path', args.out)}",
          file=sys.stdout)
    warning = val_share_warning(meta)
    if warning:
        print(warning, file=sys.stderr)
    return 0
