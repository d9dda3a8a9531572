"""Data: the running interpreter's standard-library source as a byte stream, and the recall probe.

Corpus. Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` and
``dist-packages`` excluded), sorted by relative path, read as bytes. A file is held out when a hash
of its relative path falls in the held-out fraction, so the split is the same on every machine with
the same files and files never straddle it. Each split is one token stream: a ``BOS`` token, then the
file's bytes, for every file in order; ``doc`` gives the file index of every token (``BOS`` belongs
to the file it opens).

Tokens (vocabulary of 512): bytes 0-255, ``BOS`` 256, ``PROBE`` 257, probe keys ``KEY0 ..
KEY0 + N_KEYS - 1`` and probe values ``VAL0 .. VAL0 + N_VALS - 1``; the rest is unused padding.

Text sequences are windows of ``L`` tokens of a stream; targets are the next tokens. Targets that
are bytes are scored (bits per byte); ``BOS`` targets are not.

The probe (multi-query associative recall across the whole context). A probe sequence is::

    PROBE k1 v1 k2 v2 ... kn vn | text ... | round | text ... | round   (L tokens)

The key-value prefix (``1 + 2n`` tokens) lies inside the global-token prefix of the sparse patterns.
``n`` distinct keys get independent uniform values. A *round* repeats every key once, in a fresh
random order, each followed by its value; the values of a round are scored (probe accuracy). Rounds
sit at the end of the sequence, and every query key is more than ``reach`` tokens after any earlier
occurrence of that key, where ``reach`` is the receptive field of the windowed models (layers x
window). Inside that distance the sequence holds text, other keys and other keys' values, which are
independent of the answer: a model that only sees a window (even stacked over its layers) is at
chance (``1 / N_VALS``), while global tokens, or dense attention, see the prefix directly.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import queue
import sys
import sysconfig
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

VOCAB = 512
BOS = 256
PROBE = 257
KEY0, N_KEYS = 384, 64
VAL0, N_VALS = 448, 64

IGNORE, TEXT, ANSWER = 0, 1, 2  # kinds of targets


# ------------------------------------------------------------------------------------------------
# corpus
# ------------------------------------------------------------------------------------------------
def stdlib_files(root: pathlib.Path | str | None = None) -> list[tuple[str, pathlib.Path]]:
    """``(relative posix path, path)`` of every standard-library ``.py`` file, sorted by relative path
    (``site-packages``, ``dist-packages`` and ``__pycache__`` folders are not entered)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    skip = {"site-packages", "dist-packages", "__pycache__"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for f in filenames:
            if f.endswith(".py"):
                p = pathlib.Path(dirpath, f)
                if p.is_file():
                    out.append((p.relative_to(root).as_posix(), p))
    out.sort(key=lambda t: t[0])
    return out


def is_held_out(rel: str, held_out_permille: int) -> bool:
    """Whether the file at relative path ``rel`` belongs to the held-out split (hash of the path)."""
    h = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:4], "little")
    return h % 1000 < held_out_permille


@dataclass
class Split:
    tokens: np.ndarray  # (N,) uint16
    doc: np.ndarray  # (N,) int32, file index of every token
    files: list[str]
    byte_counts: np.ndarray  # (256,) int64, occurrences of every byte value

    @property
    def n_bytes(self) -> int:
        return len(self.tokens) - len(self.files)  # every token but the BOS of each file


@dataclass
class Corpus:
    train: Split
    held: Split
    info: dict = field(default_factory=dict)


def _build_split(items: list[tuple[str, bytes]]) -> Split:
    n = sum(len(b) + 1 for _, b in items)
    tokens = np.empty(n, dtype=np.uint16)
    doc = np.empty(n, dtype=np.int32)
    counts = np.zeros(256, dtype=np.int64)
    pos = 0
    for i, (_, data) in enumerate(items):
        b = np.frombuffer(data, dtype=np.uint8)
        tokens[pos] = BOS
        tokens[pos + 1:pos + 1 + len(b)] = b
        doc[pos:pos + 1 + len(b)] = i
        counts += np.bincount(b, minlength=256)
        pos += 1 + len(b)
    return Split(tokens, doc, [r for r, _ in items], counts)


def unigram_stats(train_counts: np.ndarray, held_counts: np.ndarray) -> dict:
    """Unigram entropy of the training bytes and the held-out cross-entropy of that (add-one
    smoothed) unigram model, in bits per byte: the score of a model that learned byte frequencies
    only. Arguments: ``(256,)`` byte counts of each split."""
    ct = train_counts.astype(np.float64)
    p = ct / ct.sum()
    nz = p > 0
    h_train = float(-(p[nz] * np.log2(p[nz])).sum())
    ps = (ct + 1) / (ct.sum() + 256)
    ch = held_counts.astype(np.float64)
    h_held = float(-(ch * np.log2(ps)).sum() / max(1.0, ch.sum()))
    return {"unigram_entropy_bpb": h_train, "unigram_heldout_bpb": h_held}


@functools.lru_cache(maxsize=4)
def load_corpus(root: str | None = None, held_out_permille: int = 30) -> Corpus:
    """Read, split and tokenise the standard library (cached per process)."""
    files = stdlib_files(root)
    if not files:
        raise RuntimeError(f"no .py files found under {root or sysconfig.get_paths()['stdlib']}")
    train, held = [], []
    digest = hashlib.sha256()
    for rel, path in files:
        data = path.read_bytes()
        digest.update(rel.encode("utf-8") + b"\0" + hashlib.sha256(data).digest())
        (held if is_held_out(rel, held_out_permille) else train).append((rel, data))
    if not train or not held:
        raise RuntimeError(f"split of {len(files)} files left an empty side (held_out_permille={held_out_permille})")
    tr, he = _build_split(train), _build_split(held)
    info = {
        "source": "Python standard library .py files (sysconfig stdlib, site-packages excluded)",
        "python": sys.version.split()[0],
        "stdlib": str(root or sysconfig.get_paths()["stdlib"]),
        "files_train": len(train), "files_heldout": len(held),
        "bytes_train": tr.n_bytes, "bytes_heldout": he.n_bytes,
        "held_out_permille": held_out_permille,
        "sha256": digest.hexdigest()[:16],
        **unigram_stats(tr.byte_counts, he.byte_counts),
    }
    return Corpus(tr, he, info)


# ------------------------------------------------------------------------------------------------
# sequences
# ------------------------------------------------------------------------------------------------
@dataclass
class ProbeSpec:
    """Probe geometry for sequences of length ``L``.

    Attributes:
        n_pairs: keys in the prefix (and queries per round).
        reach: receptive field of the windowed models (layers x window), in tokens.
        rounds: start positions of the query rounds (ascending).
        window_reachable: True when no round fits more than ``reach`` after the prefix at this
            length (a single round is then put at the end, and a windowed model could reach it).
    """

    L: int
    n_pairs: int
    reach: int
    rounds: tuple
    window_reachable: bool

    @property
    def prefix_len(self) -> int:
        return 1 + 2 * self.n_pairs


def probe_spec(L: int, n_pairs: int, reach: int, max_rounds: int) -> ProbeSpec:
    """Place up to ``max_rounds`` query rounds at the end of the sequence, each query key more than
    ``reach`` tokens after every earlier occurrence of its key."""
    if not 1 <= n_pairs <= N_KEYS:
        raise ValueError(f"probe pairs must be in [1, {N_KEYS}], got {n_pairs}")
    rl = 2 * n_pairs
    if 2 * rl + 1 > L:
        raise ValueError(f"sequence length {L} is too short for a probe with {n_pairs} pairs")
    starts = []
    s = L - rl
    # a round at s: its first key (at s) must be more than reach after the last pair of what
    # precedes it (the prefix's last value at 2n, or the previous round's at s_prev + 2n - 1)
    while len(starts) < max(1, max_rounds) and s - rl > reach:
        starts.append(s)
        s = s - rl - reach - 1
    reachable = not starts
    if reachable:
        starts = [L - rl]
    return ProbeSpec(L, n_pairs, reach, tuple(sorted(starts)), reachable)


def text_window(split: Split, start: int, L: int):
    """``tokens, targets, doc, kind`` (each ``(L,)``) of the window of ``split`` at ``start``."""
    tok = split.tokens[start:start + L + 1].astype(np.int64)
    doc = split.doc[start:start + L].astype(np.int32)
    kind = np.where(tok[1:] < 256, TEXT, IGNORE).astype(np.int8)
    return tok[:-1], tok[1:], doc - doc[0], kind


def probe_sequence(rng: np.random.Generator, split: Split, spec: ProbeSpec):
    """A probe sequence over text of ``split`` (``tokens, targets, doc, kind``, each ``(L,)``)."""
    L, n = spec.L, spec.n_pairs
    start = int(rng.integers(0, len(split.tokens) - L - 1))
    tokens, targets, _, _ = text_window(split, start, L)
    tokens = tokens.copy()
    nxt = int(split.tokens[start + L])
    keys = rng.permutation(N_KEYS)[:n] + KEY0
    vals = rng.integers(0, N_VALS, n) + VAL0
    tokens[0] = PROBE
    tokens[1:1 + 2 * n:2] = keys
    tokens[2:2 + 2 * n:2] = vals
    answer = np.zeros(L, dtype=bool)
    for s in spec.rounds:
        perm = rng.permutation(n)
        tokens[s:s + 2 * n:2] = keys[perm]
        tokens[s + 1:s + 2 * n:2] = vals[perm]
        answer[s:s + 2 * n:2] = True  # at the key: predict its value
    targets = np.append(tokens[1:], nxt)
    kind = np.full(L, IGNORE, dtype=np.int8)
    kind[(targets < 256) & (np.arange(L) >= spec.prefix_len - 1)] = TEXT
    kind[answer] = ANSWER
    return tokens, targets, np.zeros(L, dtype=np.int32), kind


@dataclass
class Batch:
    """One batch, ``(B, L)`` each. ``weights`` make the loss ``mean text CE + probe_weight x mean
    answer CE`` over the batch (the answer term only when the batch has answers)."""

    tokens: torch.Tensor  # int64
    targets: torch.Tensor  # int64
    weights: torch.Tensor  # float32
    doc: torch.Tensor  # int32, document (file) id per token, 0 for probe sequences
    kind: torch.Tensor  # int8: IGNORE / TEXT / ANSWER
    n_probe: int = 0

    def to(self, device, non_blocking: bool = True) -> "Batch":
        f = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(f(self.tokens), f(self.targets), f(self.weights), f(self.doc), f(self.kind), self.n_probe)

    def pin(self) -> "Batch":
        return Batch(*(t.pin_memory() for t in (self.tokens, self.targets, self.weights, self.doc, self.kind)),
                     self.n_probe)


def collate(seqs: list, probe_weight: float) -> Batch:
    tok, tgt, doc, kind = (np.stack(x) for x in zip(*seqs))
    n_text = max(1, int((kind == TEXT).sum()))
    n_ans = int((kind == ANSWER).sum())
    w = np.where(kind == TEXT, 1.0 / n_text, 0.0)
    if n_ans:
        w = np.where(kind == ANSWER, probe_weight / n_ans, w)
    return Batch(torch.from_numpy(tok), torch.from_numpy(tgt), torch.from_numpy(w.astype(np.float32)),
                 torch.from_numpy(doc), torch.from_numpy(kind), n_probe=int((kind == ANSWER).any(1).sum()))


class TrainStream:
    """Deterministic training batches: each sequence is a probe (probability ``probe_rate``) or a
    uniformly placed text window of the training split. Depends on ``seed`` only, not on the variant."""

    def __init__(self, corpus: Corpus, L: int, batch: int, spec: ProbeSpec, probe_rate: float,
                 probe_weight: float = 1.0, seed: int = 0):
        if len(corpus.train.tokens) < L + 2:
            raise ValueError(f"training split has {len(corpus.train.tokens)} tokens, fewer than L + 2 = {L + 2}")
        self.corpus, self.L, self.B, self.spec = corpus, L, batch, spec
        self.probe_rate, self.probe_weight = probe_rate, probe_weight
        self.rng = np.random.default_rng(seed)

    def next(self) -> Batch:
        seqs = []
        for _ in range(self.B):
            if self.rng.random() < self.probe_rate:
                seqs.append(probe_sequence(self.rng, self.corpus.train, self.spec))
            else:
                start = int(self.rng.integers(0, len(self.corpus.train.tokens) - self.L - 1))
                seqs.append(text_window(self.corpus.train, start, self.L))
        return collate(seqs, self.probe_weight)


def eval_batches(corpus: Corpus, L: int, batch: int, spec: ProbeSpec, n_text: int, n_probe: int,
                 seed: int = 1234) -> list[Batch]:
    """Fixed held-out batches: ``n_text`` evenly spaced windows of the held-out split, then ``n_probe``
    probe sequences over held-out text (padded with repeats to whole batches of ``batch``; padding
    rows have kind IGNORE so they do not count)."""
    held = corpus.held
    if len(held.tokens) < L + 2:
        raise ValueError(f"held-out split has {len(held.tokens)} tokens, fewer than L + 2 = {L + 2}")
    span = len(held.tokens) - L - 1
    seqs = [text_window(held, (i * span) // max(1, n_text - 1) if n_text > 1 else 0, L) for i in range(n_text)]
    rng = np.random.default_rng(seed)
    seqs += [probe_sequence(rng, held, spec) for _ in range(n_probe)]
    out = []
    for i in range(0, len(seqs), batch):
        chunk = seqs[i:i + batch]
        while len(chunk) < batch:  # pad: same shapes as training (no recompilation), nothing scored
            t, g, d, k = chunk[-1]
            chunk.append((t, g, d, np.zeros_like(k)))
        out.append(collate(chunk, 1.0))
    return out


class Prefetcher:
    """Builds batches on a background thread (pinned when ``pin``), ``depth`` ahead."""

    def __init__(self, stream: TrainStream, pin: bool, depth: int = 3):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._stream, self._pin = stream, pin
        self._err = None
        self._t = threading.Thread(target=self._work, daemon=True)
        self._t.start()

    def _work(self):
        try:
            while not self._stop.is_set():
                b = self._stream.next()
                if self._pin:
                    b = b.pin()
                while not self._stop.is_set():
                    try:
                        self._q.put(b, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001  (re-raised in the consumer)
            self._err = e
            self._q.put(None)

    def next(self) -> Batch:
        b = self._q.get()
        if b is None:
            raise RuntimeError("batch prefetch thread failed") from self._err
        return b

    def close(self):
        self._stop.set()
        self._t.join(timeout=5)
