"""``engine convert criteo INPUT... OUT_DIR [--split train|test] [--max-bad-rows N] [--batch-size N]``
``engine convert text CORPUS OUT_DIR [--min-count N] [--max-vocab N]``.

Raw files → Arrow IPC stream files (see ``streaming.criteo``, ``streaming.text``). Prints one JSON summary
line on stdout (``{"event": "converted", "rows": ..., "bad_rows": ..., "files": [...]}``; text: also
``vocab_size``, ``tokens``, ``oov_tokens``); progress on a terminal.

OUT_DIR is written beside itself and replaced only once the conversion is complete: a failed conversion
leaves it as it was (a previous conversion included) and no partial output. It is a local directory that
holds nothing but a previous conversion (anything else is refused rather than deleted).

Exit codes: 0 success; 2 bad input (missing, empty or truncated input file, malformed line beyond
``--max-bad-rows``, an empty text vocabulary, an OUT_DIR that cannot take the conversion, bad argument);
1 writing the output failed (e.g. disk full). Either way one ``engine convert: ...`` line on stderr
naming the path.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

log = logging.getLogger("engine.convert")


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert raw data (Criteo TSV, a text corpus) to Arrow IPC stream files",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fmt = p.add_subparsers(dest="format", required=True, metavar="FORMAT")
    c = fmt.add_parser("criteo", help="Criteo train.txt layout (label, I1..I13, C1..C26; gzip accepted)",
                       description="Criteo train.txt-layout files (plain or gzip) → Arrow IPC stream files "
                                   "with label, dense[13] and C1..C26 uint64 slot-prefixed keys.")
    c.add_argument("inputs", nargs="+", metavar="INPUT", help="input file(s), read as one stream")
    c.add_argument("out_dir", metavar="OUT_DIR", help="output directory (part-*.arrow, _meta.json)")
    c.add_argument("--split", choices=("train", "test"), default=None,
                   help="keep only the canonical train (row i with i %% 5 != 4) or test rows")
    c.add_argument("--max-bad-rows", type=int, default=0, metavar="N",
                   help="malformed lines to skip (each logged) before failing (default 0: fail on the first)")
    c.add_argument("--batch-size", type=int, default=8192, metavar="N", help="rows per record batch")
    c.add_argument("--rows-per-file", type=int, default=1 << 20, metavar="N", help="rows per part file")
    c.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    t = fmt.add_parser("text", help="text corpus (one document per line; gzip accepted) → vocab + token ids",
                       description="A plain or gzip text corpus (one document per line, whitespace tokens) → "
                                   "OUT_DIR/vocab.arrow (word, count) + OUT_DIR/corpus/part-*.arrow "
                                   "(tokens: list<uint32> per document chunk of <= 10,000 tokens), the "
                                   "Word2Vec input.")
    t.add_argument("corpus", metavar="CORPUS", help="input text file (plain or gzip)")
    t.add_argument("out_dir", metavar="OUT_DIR", help="output directory")
    t.add_argument("--min-count", type=int, default=5, metavar="N",
                   help="words seen fewer than N times are out of vocabulary (default 5)")
    t.add_argument("--max-vocab", type=int, default=None, metavar="N",
                   help="keep only the N most frequent words (default: no limit)")
    t.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _write_failed(out_dir: str, e: OSError) -> int:
    print(f"engine convert: {out_dir}: writing the conversion failed, the directory was left as it was: {e}",
          file=sys.stderr)
    return 1


def run_text(args) -> int:
    from streaming.errors import DataFormatError
    from streaming.text import ConvertError, EmptyVocabularyError, convert_text
    if args.min_count < 1:
        print(f"engine convert: --min-count must be >= 1, got {args.min_count}", file=sys.stderr)
        return 2
    if args.max_vocab is not None and args.max_vocab < 1:
        print(f"engine convert: --max-vocab must be >= 1, got {args.max_vocab}", file=sys.stderr)
        return 2
    try:
        r = convert_text(args.corpus, args.out_dir, min_count=args.min_count, max_vocab=args.max_vocab)
    except FileNotFoundError as e:
        print(f"engine convert: {e}", file=sys.stderr)
        return 2
    except DataFormatError as e:
        print(f"engine convert: bad input: {e}", file=sys.stderr)
        return 2
    except EmptyVocabularyError as e:
        print(f"engine convert: {e.path}: {e.explain('--min-count')}", file=sys.stderr)
        return 2
    except (ConvertError, ValueError, IsADirectoryError) as e:
        print(f"engine convert: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        return _write_failed(args.out_dir, e)
    print(json.dumps({"event": "converted", "format": "text", "out_dir": r.out_dir, "lines": r.lines,
                      "rows": r.rows, "vocab_size": r.vocab_size, "tokens": r.total_tokens,
                      "retained_tokens": r.retained_tokens, "oov_tokens": r.oov_tokens, "files": r.files,
                      "seconds": round(r.seconds, 3)}), flush=True)
    return 0


def run(args) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.format == "text":
        return run_text(args)
    from streaming.criteo import ConvertError, convert_criteo
    from streaming.errors import DataFormatError, SchemaError

    from streaming.criteo import MAX_BATCH_SIZE
    for name in ("max_bad_rows", "batch_size", "rows_per_file"):
        v = getattr(args, name)
        if v < (0 if name == "max_bad_rows" else 1):
            flag = "--" + name.replace("_", "-")
            print(f"engine convert: {flag} must be >= {0 if name == 'max_bad_rows' else 1}, got {v}",
                  file=sys.stderr)
            return 2
    if args.batch_size > MAX_BATCH_SIZE:
        print(f"engine convert: --batch-size must be <= {MAX_BATCH_SIZE} (rows per record batch, whose buffers "
              f"are allocated up front), got {args.batch_size}", file=sys.stderr)
        return 2
    try:
        report = convert_criteo(args.inputs, args.out_dir, split=args.split, batch_size=args.batch_size,
                                rows_per_file=args.rows_per_file, max_bad_rows=args.max_bad_rows)
    except FileNotFoundError as e:
        print(f"engine convert: {e}", file=sys.stderr)
        return 2
    except (DataFormatError, SchemaError) as e:
        print(f"engine convert: bad input: {e}", file=sys.stderr)
        return 2
    except (ConvertError, ValueError) as e:
        print(f"engine convert: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        return _write_failed(args.out_dir, e)
    print(json.dumps({"event": "converted", "out_dir": report.out_dir, "lines": report.lines,
                      "rows": report.rows, "bad_rows": report.bad_rows, "files": report.files,
                      "seconds": round(report.seconds, 3)}), flush=True)
    return 0
