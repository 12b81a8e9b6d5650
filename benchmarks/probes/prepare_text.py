"""``ddp-exp prepare`` on a generated corpus (issue 39): the tokenizer's tokens/s and prepare's
peak resident memory.

    python -m benchmarks.probes.prepare_text              # 200 MB (the target: peak RSS < 1 GB)
    python -m benchmarks.probes.prepare_text --mb 10      # a quick look

The corpus is generated here, deterministic: files of Chinese example text
(:mod:`ddp_exp.data.example_text`) and English (the built-in corpus's text), each file one
document, cycled with a document number until ``--mb`` MB. Reported:

* ``prepare_s`` and ``peak_rss_mb``: ``ddp-exp prepare --tokenizer bpe --vocab-size 8192`` as a
  child process, wall seconds and its peak RSS (``getrusage(RUSAGE_CHILDREN).ru_maxrss``);
* ``encode_tokens_per_s``: the trained tokenizer's ``encode_batch`` (every core) on the first
  8 MB of the corpus, tokens per second;
* ``tokens``: the prepared folder's token count.

Prints ``BENCH_RESULT {json}``. Run by the ``prepare_text`` group
(``benchmarks/groups/prepare_text.py``), or alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_corpus(folder: Path, megabytes: float) -> int:
    """Write about ``megabytes`` MB of text files to ``folder``; returns the bytes written."""
    from pydoc_data.topics import topics

    import numpy as np

    from ddp_exp.data.example_text import chinese_document

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    english = [topics[k] for k in sorted(topics)]
    chinese = [chinese_document(rng, 8) for _ in range(400)]
    target, written, i = int(megabytes * 1e6), 0, 0
    while written < target:
        parts = [f"document {i}\n"]
        size = 0
        while size < 2_000_000:  # ~2 MB files
            part = english[i % len(english)] if i % 3 else chinese[i % len(chinese)]
            parts.append(part)
            size += len(part.encode("utf-8"))
            i += 1
        data = "\n".join(parts).encode("utf-8")
        (folder / f"f{i:07d}.txt").write_bytes(data)
        written += len(data)
    return written


def main(argv: list[str] | None = None) -> dict:
    """Run the measurement; prints (``BENCH_RESULT``) and returns one JSON row. Raises
    SystemExit with prepare's error output when it fails."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=200.0, help="corpus size in MB (default 200)")
    p.add_argument("--vocab-size", type=int, default=8192)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        corpus, out = Path(tmp) / "corpus", Path(tmp) / "prepared"
        size = write_corpus(corpus, args.mb)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "ddp_exp", "prepare", str(corpus), "--out",
                               str(out), "--tokenizer", "bpe", "--vocab-size",
                               str(args.vocab_size), "--no-progress"],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL)
        seconds = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(proc.stderr)
        peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        meta = json.loads((out / "meta.json").read_text())
        from ddp_exp.data.text_tokenizer import TextTokenizer

        tok = TextTokenizer.load(str(out))
        texts, total = [], 0
        for path in sorted(corpus.iterdir()):
            texts.append(path.read_bytes().decode("utf-8"))
            total += len(texts[-1])
            if total > 8e6:
                break
        t1 = time.perf_counter()
        tokens = sum(len(ids) for ids in tok.encode_batch(texts))
        encode_s = time.perf_counter() - t1
    row = {"corpus_mb": round(size / 1e6, 1), "cores": os.cpu_count(),
           "prepare_s": round(seconds, 1), "peak_rss_mb": round(peak_kb / 1024, 1),
           "tokens": meta["train"]["tokens"] + meta["val"]["tokens"],
           "encode_tokens_per_s": round(tokens / encode_s)}
    print("BENCH_RESULT " + json.dumps(row))
    return row


if __name__ == "__main__":
    main()
