"""Text corpus → vocabulary + Arrow IPC stream files of token ids (the Word2Vec input).

Input: plain or gzip text (gzip detected by its magic bytes), one document per line, tokens separated by
whitespace (see ``streaming._text_kernels`` for the exact set). Two streaming passes over the file:

1. count every token (memory: one block of text plus the vocabulary with counts);
2. map tokens to ids and write the corpus.

Output layout::

    OUT_DIR/vocab.arrow            word : string, count : uint64; sorted by count desc, then word
                                   (bytewise); word id = row index
    OUT_DIR/corpus/part-00000.arrow ...
                                   tokens : list<uint32> (one row per document chunk),
                                   raw_tokens : uint32 (tokens of the chunk before the OOV drop)
    OUT_DIR/_meta.json             written last: source (path, size, mtime), parameters, counts

The conversion is written into a new directory beside ``OUT_DIR`` and replaces it only once complete
(``streaming.criteo._staged_output``): a failed conversion leaves ``OUT_DIR`` as it was and no partial
output. A corpus whose vocabulary would be empty (no word reaching ``min_count``) is refused
(``EmptyVocabularyError``): it would train nothing.

Documents are cut into chunks of at most ``chunk_tokens`` raw tokens (none dropped), then out-of-vocabulary
tokens (count < ``min_count`` or beyond ``max_vocab``) are dropped inside each chunk and counted: exactly
what gensim's ``LineSentence(max_sentence_length=10000)`` followed by its vocabulary lookup trains on.
Empty lines give no row; a chunk with only out-of-vocabulary tokens gives an empty row.

Worked example (``min_count=2``)::

    "the cat sat\\n"        vocab: the 3, cat 2         rows: tokens=[0, 1]    raw_tokens=3
    "the cat the dog\\n"    (sat, dog: count 1, OOV)          tokens=[0, 1, 0] raw_tokens=4
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import _text_kernels
from .criteo import ConvertError, _read_error, _staged_output
from .errors import DataFormatError

__all__ = ["convert_text", "TextConvertReport", "text_arrow_is_current", "read_vocab", "corpus_schema",
           "vocab_schema", "corpus_files", "vocab_fingerprint", "conversion_fingerprint", "ConvertError",
           "EmptyVocabularyError", "NotTextError", "META_FILE", "VOCAB_FILE", "CORPUS_DIR", "MAX_CHUNK_TOKENS"]

log = logging.getLogger(__name__)

META_FILE = "_meta.json"
VOCAB_FILE = "vocab.arrow"
CORPUS_DIR = "corpus"
FORMAT = "text-arrow/1"
#: gensim's MAX_WORDS_IN_BATCH / word2vec_inner MAX_SENTENCE_LEN
MAX_CHUNK_TOKENS = 10_000
_BLOCK_BYTES = 16 << 20


class EmptyVocabularyError(ConvertError):
    """No word of the corpus occurs ``min_count`` times or more (or the corpus holds no word at all): its
    conversion would train nothing.

    Parameters
    ----------
    path : str
        The corpus.
    min_count : int
    lines, total_tokens, distinct_words : int
        What the corpus holds.
    top_count : int
        Occurrences of its most frequent word (0 without words).
    """

    def __init__(self, path, min_count: int, lines: int, total_tokens: int, distinct_words: int,
                 top_count: int):
        self.min_count, self.lines, self.total_tokens = int(min_count), int(lines), int(total_tokens)
        self.distinct_words, self.top_count = int(distinct_words), int(top_count)
        super().__init__(path, self.explain("min_count"))

    def explain(self, min_count_name: str) -> str:
        """The reason, naming the ``min_count`` setting as the caller knows it (``--min-count``,
        ``model.min_count``)."""
        if self.total_tokens == 0:
            return (f"empty vocabulary ({min_count_name}={self.min_count}): the corpus holds no words "
                    f"({self.lines} lines)")
        return (f"empty vocabulary: no word occurs {min_count_name}={self.min_count} times or more (the most "
                f"frequent of its {self.distinct_words} distinct words occurs {self.top_count} times, "
                f"{self.total_tokens} tokens in all); lower {min_count_name}")

    def __reduce__(self):
        return type(self), (self.path, self.min_count, self.lines, self.total_tokens, self.distinct_words,
                            self.top_count)


def vocab_schema() -> pa.Schema:
    """Schema of ``vocab.arrow``: ``word : string``, ``count : uint64``."""
    return pa.schema([pa.field("word", pa.string(), nullable=False),
                      pa.field("count", pa.uint64(), nullable=False)], metadata={"format": FORMAT})


def corpus_schema() -> pa.Schema:
    """Schema of the corpus parts: ``tokens : list<uint32>``, ``raw_tokens : uint32``."""
    return pa.schema([pa.field("tokens", pa.list_(pa.field("item", pa.uint32(), nullable=False)),
                               nullable=False),
                      pa.field("raw_tokens", pa.uint32(), nullable=False)], metadata={"format": FORMAT})


@dataclasses.dataclass
class TextConvertReport:
    """What ``convert_text`` did (also stored in ``_meta.json``).

    Attributes
    ----------
    out_dir : str
    files : list of str
        Corpus parts, relative to ``out_dir``, in order.
    vocab_size : int
        Words kept.
    total_tokens : int
        Raw tokens in the corpus (what gensim calls ``corpus_total_words``).
    retained_tokens : int
        Tokens written (in vocabulary); ``total_tokens - retained_tokens`` were dropped as OOV.
    oov_tokens : int
    distinct_words : int
        Distinct tokens before ``min_count``/``max_vocab``.
    lines : int
        Input lines (documents), empty ones included.
    empty_lines : int
        Lines without tokens (no row written).
    rows : int
        Rows written (document chunks).
    split_documents : int
        Lines longer than ``chunk_tokens`` (cut into several rows).
    tokens_crc32 : str
        CRC-32 (8 lowercase hex digits) of the corpus parts' record batches in order: each batch's
        token ids (uint32, little-endian, the list values) then its ``raw_tokens`` column (uint32). A corpus with its lines reordered keeps the
        vocabulary and the token count but changes it.
    seconds : float
    """

    out_dir: str
    files: list
    vocab_size: int = 0
    total_tokens: int = 0
    retained_tokens: int = 0
    oov_tokens: int = 0
    distinct_words: int = 0
    lines: int = 0
    empty_lines: int = 0
    rows: int = 0
    split_documents: int = 0
    tokens_crc32: str = ""
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.seconds if self.seconds > 0 else 0.0


def _source_info(path) -> dict:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _params(min_count, max_vocab, chunk_tokens) -> dict:
    return {"min_count": int(min_count), "max_vocab": None if max_vocab is None else int(max_vocab),
            "chunk_tokens": int(chunk_tokens)}


def text_arrow_is_current(corpus, out_dir, *, min_count=5, max_vocab=None,
                          chunk_tokens=MAX_CHUNK_TOKENS) -> bool:
    """True when ``out_dir`` holds a complete conversion of ``corpus`` (same path, size, mtime) with these
    parameters."""
    try:
        meta = json.loads((Path(out_dir) / META_FILE).read_text())
        src = _source_info(os.fspath(corpus))
    except (OSError, ValueError):
        return False
    return (meta.get("format") == FORMAT and meta.get("source") == src
            and meta.get("params") == _params(min_count, max_vocab, chunk_tokens)
            and (Path(out_dir) / VOCAB_FILE).is_file()
            and all((Path(out_dir) / f).is_file() for f in meta.get("files", [])))


def corpus_files(out_dir) -> list:
    """The corpus part paths of a finished conversion, in order (from ``_meta.json``).

    Raises
    ------
    FileNotFoundError
        If ``out_dir`` holds no finished conversion (``_meta.json`` is written last).
    """
    meta_path = Path(out_dir) / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found: run convert_text (engine convert text) first")
    meta = json.loads(meta_path.read_text())
    return [str(Path(out_dir) / f) for f in meta["files"]]


def read_vocab(path):
    """Read ``vocab.arrow`` (or the directory holding it).

    Returns
    -------
    words : list of str, length V
        ``words[i]`` is the word with id ``i``.
    counts : uint64[V]
    """
    path = Path(path)
    if path.is_dir():
        path = path / VOCAB_FILE
    with pa.OSFile(str(path), "r") as f:     # not mapped: a file truncated meanwhile is no SIGBUS later
        table = pa.ipc.open_stream(f).read_all()
    return table.column("word").to_pylist(), table.column("count").to_numpy().astype(np.uint64)


def vocab_fingerprint(path) -> dict:
    """What identifies a vocabulary (the word of every id): size and CRC-32 of ``vocab.arrow``'s bytes.

    Parameters
    ----------
    path : str or PathLike
        ``vocab.arrow`` or the (local) directory holding it.

    Returns
    -------
    dict
        ``{"vocab_bytes": int (bytes), "vocab_crc32": str (8 lowercase hex digits)}``.

    Raises
    ------
    FileNotFoundError
        No such file.
    """
    from hdfs_io.checksum import checksum_stream
    path = Path(path)
    if path.is_dir():
        path = path / VOCAB_FILE
    with pa.OSFile(str(path), "r") as f:
        entry = checksum_stream(f)
    return {"vocab_bytes": int(entry.size), "vocab_crc32": entry.crc32}


def conversion_fingerprint(out_dir) -> dict:
    """What identifies a finished conversion: :func:`vocab_fingerprint` plus ``vocab_words`` (int),
    ``total_tokens`` (int, raw tokens of one pass over the corpus) and ``tokens_crc32`` (str, the rows as
    written: ``TextConvertReport``; absent for conversions made before it was recorded) from
    ``_meta.json``. A re-conversion of a changed corpus changes at least one of them, reordered lines too.

    Raises
    ------
    FileNotFoundError
        ``out_dir`` holds no finished conversion (no ``_meta.json`` or ``vocab.arrow``).
    """
    meta_path = Path(out_dir) / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found: run convert_text (engine convert text) first")
    meta = json.loads(meta_path.read_text())
    out = {"vocab_words": int(meta.get("vocab_size", -1)), **vocab_fingerprint(Path(out_dir) / VOCAB_FILE),
           "total_tokens": int(meta.get("total_tokens", -1))}
    if meta.get("tokens_crc32"):        # conversions before it was recorded have none
        out["tokens_crc32"] = str(meta["tokens_crc32"])
    return out


def _open(path: str):
    raw = pa.OSFile(path, "r")
    return pa.CompressedInputStream(raw, "gzip") if _is_gzip(path) else raw


def _blocks(path: str, block_bytes: int):
    """Yield ``uint8`` arrays of whole lines (the last may lack its newline), about ``block_bytes`` each.

    Raises ``ConvertError`` naming ``path`` when it cannot be read (e.g. truncated gzip)."""
    try:
        stream = _open(path)
    except OSError as e:
        raise _read_error(path, e) from e
    carry = b""
    try:
        while True:
            try:
                chunk = stream.read(block_bytes)
            except OSError as e:
                raise _read_error(path, e) from e
            if not chunk:
                if carry:
                    yield np.frombuffer(carry, np.uint8)
                return
            data = carry + chunk if carry else chunk
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                carry = data
                continue
            carry = data[cut:]
            yield np.frombuffer(data, np.uint8)[:cut]
    finally:
        stream.close()


def _tokens(block):
    """Tokenize one block: ``(tokens : pyarrow.BinaryArray, line_ntok : int64[L])``."""
    packed, offsets, line_ntok = _text_kernels.tokenize(block)
    if offsets[-1] >= 2**31:
        arr = pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(offsets) - 1,
                                               [None, pa.py_buffer(offsets), pa.py_buffer(packed)])
    else:
        arr = pa.BinaryArray.from_buffers(pa.binary(), len(offsets) - 1,
                                          [None, pa.py_buffer(offsets.astype(np.int32)),
                                           pa.py_buffer(packed)])
    return arr, line_ntok


def _progress(path, desc):
    if not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm
    return tqdm(total=os.stat(path).st_size, unit="B", unit_scale=True, desc=desc, leave=False)


#: bytes at the start of a corpus (after gzip) that must hold no NUL byte (``_check_text``)
TEXT_CHECK_BYTES = 1 << 16


class NotTextError(ConvertError):
    """The corpus is not text: a NUL byte in its first ``TEXT_CHECK_BYTES`` (decompressed), which no text
    file holds (a binary file: an image, an archive, an Arrow or Parquet file, a program). Before, a
    binary file whose byte strings each occurred fewer than ``min_count`` times was refused as an "empty
    vocabulary". Text in another encoding has no NUL byte: it is read, and a frequent token that is not
    UTF-8 is refused naming its line (``DataFormatError``).

    Parameters
    ----------
    path : str
    offset : int
        Byte offset of the first NUL byte (in the decompressed text for a gzip file).
    gzip : bool
        Whether the file is gzip.
    """

    def __init__(self, path, offset: int, gzip: bool = False):
        self.offset, self.gzip = int(offset), bool(gzip)
        where = f"byte offset {offset}{' of the decompressed text' if gzip else ''}"
        super().__init__(path, f"not text: {where} holds a NUL byte (a binary file? engine convert text reads "
                               f"UTF-8 text, plain or gzip, one document a line)")

    def __reduce__(self):
        return type(self), (self.path, self.offset, self.gzip)


def _check_text(path: str, head) -> None:
    """Raise ``NotTextError`` when ``head`` (``uint8[n]``, the corpus's first bytes) holds a NUL byte in
    its first ``TEXT_CHECK_BYTES``. Only the start is checked: a file that starts as text is read as
    text (a rare token that is not UTF-8 stays out of the vocabulary, a frequent one is a
    ``DataFormatError`` naming its line)."""
    nul = bytes(head[:TEXT_CHECK_BYTES]).find(b"\0")
    if nul >= 0:
        raise NotTextError(path, nul, gzip=_is_gzip(path))


def _is_gzip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _count_pass(path: str, report: TextConvertReport, block_bytes: int) -> pa.Table:
    acc = pa.table({"word": pa.array([], pa.binary()), "count": pa.array([], pa.int64())})
    bar = _progress(path, "vocab")
    for i, block in enumerate(_blocks(path, block_bytes)):
        if i == 0:
            _check_text(path, block)
        toks, line_ntok = _tokens(block)
        report.total_tokens += len(toks)
        report.lines += len(line_ntok)
        vc = pc.value_counts(toks)
        blk = pa.table({"word": vc.field("values").cast(pa.binary()), "count": vc.field("counts")})
        acc = (pa.concat_tables([acc, blk]).group_by("word", use_threads=False)
               .aggregate([("count", "sum")]).rename_columns(["word", "count"]))
        if bar is not None:
            bar.update(len(block))
    if bar is not None:
        bar.close()
    return acc


def _select_vocab(acc: pa.Table, path: str, min_count: int, max_vocab) -> pa.Table:
    kept = acc.filter(pc.greater_equal(acc.column("count"), min_count))
    order = pc.sort_indices(kept, sort_keys=[("count", "descending"), ("word", "ascending")])
    kept = kept.take(order)
    if max_vocab is not None and kept.num_rows > max_vocab:
        kept = kept.slice(0, max_vocab)
    try:
        words = kept.column("word").cast(pa.string())
    except pa.ArrowInvalid as e:
        bad = next(w for w in kept.column("word").to_pylist() if not _is_utf8(w))
        raise DataFormatError(path, _line_of(path, bad), "token",
                              f"expected UTF-8 text, got the bytes {bad!r}") from e
    return pa.table({"word": words, "count": kept.column("count").cast(pa.uint64())},
                    schema=vocab_schema())


def _text_owned(entry: os.DirEntry) -> bool:
    """Whether an entry of an existing ``OUT_DIR`` is conversion output (``_staged_output``)."""
    if entry.name == CORPUS_DIR and entry.is_dir(follow_symlinks=False):
        with os.scandir(entry.path) as parts:
            return all(p.name.startswith("part-") and p.name.endswith(".arrow")
                       and not p.is_dir(follow_symlinks=False) for p in parts)
    return entry.name in (VOCAB_FILE, META_FILE, META_FILE + ".tmp") and not entry.is_dir(follow_symlinks=False)


def _line_of(path: str, token: bytes) -> int:
    """1-based line of ``path`` where ``token`` first occurs as a token, or 0 when it cannot be found
    (a second read, on the error path only)."""
    base = 0
    try:
        for block in _blocks(path, 1 << 24):     # whole lines, ~16 MB at a time
            lines = block.tobytes().split(b"\n")
            for i, line in enumerate(lines, 1):
                if token in line.split():
                    return base + i
            base += len(lines) - (1 if lines and not lines[-1] else 0)
    except (OSError, ValueError):
        pass
    return 0


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


class _CorpusWriter:
    """Writes rows to rotating IPC stream files, record batches of about ``batch_tokens`` tokens."""

    def __init__(self, out_dir: Path, batch_tokens: int, file_tokens: int):
        self.out_dir, self.batch_tokens, self.file_tokens = out_dir, batch_tokens, file_tokens
        self.schema = corpus_schema()
        self.files: list[str] = []
        self._writer = self._sink = None
        self._file_tok = 0
        self.crc = 0        # zlib.crc32 of each record batch's token ids, then its raw lengths, in order

    def write(self, row_offsets, values, raw_len):
        n_rows = len(raw_len)
        start = 0
        while start < n_rows:
            if self._writer is None or self._file_tok >= self.file_tokens:
                self._open_next()
            budget = min(self.batch_tokens, max(self.file_tokens - self._file_tok, 1))
            stop = int(np.searchsorted(row_offsets, row_offsets[start] + budget, side="right")) - 1
            stop = min(max(stop, start + 1), n_rows)
            offs = row_offsets[start:stop + 1] - row_offsets[start]
            vals = values[row_offsets[start]:row_offsets[stop]]
            tokens = pa.ListArray.from_arrays(pa.array(offs, pa.int32()), pa.array(vals, pa.uint32()),
                                              type=self.schema.field("tokens").type)
            rb = pa.RecordBatch.from_arrays([tokens, pa.array(raw_len[start:stop], pa.uint32())],
                                            schema=self.schema)
            self._writer.write_batch(rb)
            self.crc = zlib.crc32(np.ascontiguousarray(vals, "<u4"), self.crc)
            self.crc = zlib.crc32(np.ascontiguousarray(raw_len[start:stop], "<u4"), self.crc)
            self._file_tok += int(offs[-1])
            start = stop

    def _open_next(self):
        self.close()
        name = f"{CORPUS_DIR}/part-{len(self.files):05d}.arrow"
        self._sink = pa.OSFile(str(self.out_dir / name), "wb")
        self._writer = pa.ipc.new_stream(self._sink, self.schema)
        self.files.append(name)
        self._file_tok = 0

    def close(self):
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self._writer = self._sink = None


def convert_text(corpus, out_dir, *, min_count: int = 5, max_vocab: int | None = None,
                 chunk_tokens: int = MAX_CHUNK_TOKENS, file_tokens: int = 2_000_000,
                 batch_tokens: int = 100_000, block_bytes: int = _BLOCK_BYTES) -> TextConvertReport:
    """Convert a text corpus into ``vocab.arrow`` + Arrow IPC stream parts of token ids (see the module
    docstring for the layout).

    Parameters
    ----------
    corpus : str or PathLike
        Plain or gzip text, one document per line.
    out_dir : str or PathLike
        A local directory: created if missing (with its parents), else replaced as a whole once the new
        conversion is complete; it may hold only a previous conversion (``vocab.arrow``, ``corpus/``,
        ``_meta.json``). On any error it is left as it was.
    min_count : int
        Words with fewer occurrences are out of vocabulary (gensim's ``min_count``).
    max_vocab : int, optional
        Keep only this many most frequent words (ties broken by word), after ``min_count``.
    chunk_tokens : int
        Maximum raw tokens per row (1..10,000: gensim's word2vec kernel trains on at most 10,000 words of a
        sentence and silently drops the rest; we cut instead).
    file_tokens : int
        Start a new part file after about this many written tokens (so workers can split the files).
    batch_tokens : int
        About this many tokens per record batch (at least one row).
    block_bytes : int
        Uncompressed bytes read per block (memory bound; a longer line is read whole).

    Returns
    -------
    TextConvertReport

    Raises
    ------
    ValueError
        On a bad parameter (named in the message).
    DataFormatError
        If a kept word is not valid UTF-8.
    EmptyVocabularyError
        No word occurs ``min_count`` times or more (an empty corpus included).
    ConvertError
        ``corpus`` cannot be read (e.g. truncated gzip), or ``out_dir`` cannot take the conversion (a
        regular file, a URI, a directory holding other files, not writable); names the path.
    FileNotFoundError
        If ``corpus`` does not exist.
    OSError
        Writing the output failed (e.g. the disk is full); ``out_dir`` is left as it was.
    """
    if not 1 <= chunk_tokens <= MAX_CHUNK_TOKENS:
        raise ValueError(f"chunk_tokens: expected 1..{MAX_CHUNK_TOKENS}, got {chunk_tokens}")
    if min_count < 1:
        raise ValueError(f"min_count: expected an int >= 1, got {min_count}")
    if max_vocab is not None and max_vocab < 1:
        raise ValueError(f"max_vocab: expected None or an int >= 1, got {max_vocab}")
    if file_tokens < 1 or batch_tokens < 1 or block_bytes < 1:
        raise ValueError(f"file_tokens, batch_tokens, block_bytes: expected ints >= 1, got "
                         f"{file_tokens}, {batch_tokens}, {block_bytes}")
    corpus = os.fspath(corpus)
    if not os.path.isfile(corpus):
        raise FileNotFoundError(f"text corpus not found: {corpus}")
    t0 = time.perf_counter()
    report = TextConvertReport(out_dir=str(Path(out_dir)), files=[])
    with _staged_output(out_dir, _text_owned) as stage:
        (stage / CORPUS_DIR).mkdir()
        _convert_into(stage, corpus, report, min_count, max_vocab, chunk_tokens, file_tokens, batch_tokens,
                      block_bytes)
        report.seconds = time.perf_counter() - t0
        meta = {"format": FORMAT, "source": _source_info(corpus),
                "params": _params(min_count, max_vocab, chunk_tokens),
                "files": report.files, "vocab_file": VOCAB_FILE,
                **{k: getattr(report, k) for k in ("vocab_size", "total_tokens", "retained_tokens",
                                                   "oov_tokens", "distinct_words", "lines", "empty_lines",
                                                   "rows", "split_documents", "tokens_crc32")}}
        (stage / META_FILE).write_text(json.dumps(meta, indent=1))
    log.info("converted %s: %d tokens (%d kept, %d OOV) in %d rows, %d files, %.1f s (%.0f tokens/s)",
             corpus, report.total_tokens, report.retained_tokens, report.oov_tokens, report.rows,
             len(report.files), report.seconds, report.tokens_per_s)
    return report


def _convert_into(out: Path, corpus: str, report: TextConvertReport, min_count, max_vocab, chunk_tokens,
                  file_tokens, batch_tokens, block_bytes) -> None:
    """Both passes of ``convert_text`` into the (new, empty but for ``corpus/``) directory ``out``."""
    acc = _count_pass(corpus, report, block_bytes)
    report.distinct_words = acc.num_rows
    vocab = _select_vocab(acc, corpus, min_count, max_vocab)
    if vocab.num_rows == 0:
        top = int(pc.max(acc.column("count")).as_py() or 0) if acc.num_rows else 0
        raise EmptyVocabularyError(corpus, min_count, report.lines, report.total_tokens, acc.num_rows, top)
    del acc
    report.vocab_size = vocab.num_rows
    with pa.OSFile(str(out / VOCAB_FILE), "wb") as sink, pa.ipc.new_stream(sink, vocab.schema) as w:
        w.write_table(vocab)
    log.info("vocabulary: %d of %d distinct words have count >= %d (max_vocab %s); %d tokens",
             report.vocab_size, report.distinct_words, min_count, max_vocab, report.total_tokens)

    value_set = vocab.column("word").cast(pa.binary())
    writer = _CorpusWriter(out, batch_tokens, file_tokens)
    bar = _progress(corpus, "tokens")
    try:
        for block in _blocks(corpus, block_bytes):
            toks, line_ntok = _tokens(block)
            ids = pc.fill_null(pc.index_in(toks, value_set=value_set), -1).to_numpy().astype(np.int32)
            row_offsets, values, raw_len, n_oov = _text_kernels.build_rows(ids, line_ntok, chunk_tokens)
            report.oov_tokens += int(n_oov)
            report.retained_tokens += len(values)
            report.rows += len(raw_len)
            report.empty_lines += int(np.count_nonzero(line_ntok == 0))
            report.split_documents += int(np.count_nonzero(line_ntok > chunk_tokens))
            writer.write(row_offsets, values, raw_len)
            if bar is not None:
                bar.update(len(block))
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    report.files = writer.files
    report.tokens_crc32 = f"{writer.crc:08x}"
