"""The step-4 corpus of a GPU session, tokenized here so that it travels small and the device trains on exactly
these ids: the standard library's docstrings (this machine's Python), a byte-level BPE tokenizer trained on them,
and the token ids as a uint16 ``.npy`` stream.

    python scripts/gpu/pack_corpus.py --out .gpu/corpus [--vocab 8192]

Writes ``OUT/tokens.npy`` (1-D uint16), ``OUT/tokenizer/`` (a Hugging Face tokenizer folder) and ``OUT/meta.json``
(documents, characters, tokens, vocabulary, Python version). Train on it with
``--dataset tokens:OUT/tokens.npy --tokenizer OUT/tokenizer``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from analysis.model.reference.data import stdlib_docstrings, tokenize_docs, train_bpe  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size (<= 65536: ids are stored as uint16)")
    args = p.parse_args(argv)
    if not 256 < args.vocab <= 65536:
        p.error(f"--vocab must be in (256, 65536] for uint16 ids; got {args.vocab}.")
    docs = stdlib_docstrings()
    tok = train_bpe(iter(docs), args.vocab)
    ids = tokenize_docs(tok, iter(docs))
    args.out.mkdir(parents=True, exist_ok=True)
    np.save(args.out / "tokens.npy", ids.astype(np.uint16), allow_pickle=False)
    tok.save_pretrained(args.out / "tokenizer")
    meta = {
        "corpus": "Python standard-library docstrings",
        "python": platform.python_version(),
        "documents": len(docs),
        "characters": sum(map(len, docs)),
        "tokens": int(len(ids)),
        "vocab": len(tok),
        "dtype": "uint16",
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(
        f"corpus: {meta['documents']} docstrings, {meta['characters']:,} characters -> {meta['tokens']:,} tokens "
        f"(vocab {meta['vocab']}) in {args.out}"
    )
    return meta


if __name__ == "__main__":
    main()
