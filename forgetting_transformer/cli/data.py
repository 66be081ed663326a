"""Built-in byte-level data: the Python standard library's own source files.

Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (site-packages excluded) is one
document: ``[BOS] + utf-8 bytes + [EOS]``, token ids 0..255 for bytes and three specials.
The split into train and validation is by FILE (a stable hash of the path relative to the stdlib
root), so no validation file is ever seen in training. Every sample is a window cropped inside a
single document; unrelated files are never glued together. Batches are a pure function of
``(seed, step)``, so the data state of a checkpoint is just the step.
"""
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259
IGNORE_INDEX = -100


def encode(text: str, bos: bool = True) -> List[int]:
    return ([BOS] if bos else []) + list(text.encode("utf-8"))


def decode(ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_source_files(root: Optional[str] = None, suffix: Optional[str] = ".py") -> List[str]:
    """Sorted relative paths of the files under root ending in ``suffix`` (None: every file not
    starting with "."), without site-packages/dist-packages/__pycache__/hidden directories."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and
                             d not in ("site-packages", "dist-packages", "__pycache__"))
        for f in filenames:
            if (f.endswith(suffix) if suffix else not f.startswith(".")):
                out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(out)


def is_validation(relpath: str, val_fraction: float) -> bool:
    """Deterministic by-file split: a stable hash of the relative path (not Python's hash())."""
    h = int.from_bytes(hashlib.sha1(relpath.replace(os.sep, "/").encode()).digest()[:8], "big")
    return (h % 1_000_000) < val_fraction * 1_000_000


def split_files(files: Sequence[str], val_fraction: float) -> Tuple[List[str], List[str]]:
    train = [f for f in files if not is_validation(f, val_fraction)]
    val = [f for f in files if is_validation(f, val_fraction)]
    return train, val


@dataclass
class Documents:
    """Documents stored back to back in one int16 tensor; doc i is tokens[starts[i]:starts[i]+lengths[i]]."""
    names: List[str]
    tokens: torch.Tensor   # (total,) int16
    starts: np.ndarray     # (n,) int64
    lengths: np.ndarray    # (n,) int64

    @classmethod
    def from_texts(cls, names: Sequence[str], blobs: Sequence[bytes]) -> "Documents":
        parts, starts, lengths, pos = [], [], [], 0
        for b in blobs:
            arr = np.empty(len(b) + 2, dtype=np.int16)
            arr[0], arr[-1] = BOS, EOS
            arr[1:-1] = np.frombuffer(b, dtype=np.uint8)
            parts.append(arr)
            starts.append(pos)
            lengths.append(len(arr))
            pos += len(arr)
        tokens = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int16))
        return cls(list(names), tokens, np.asarray(starts, np.int64), np.asarray(lengths, np.int64))

    @classmethod
    def from_files(cls, root: str, relpaths: Sequence[str], max_bytes: Optional[int] = None):
        blobs = []
        for r in relpaths:
            with open(os.path.join(root, r), "rb") as fh:
                blobs.append(fh.read(max_bytes) if max_bytes else fh.read())
        return cls.from_texts(relpaths, blobs)

    def __len__(self):
        return len(self.names)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def doc(self, i: int) -> torch.Tensor:
        s = int(self.starts[i])
        return self.tokens[s:s + int(self.lengths[i])]


def crop(doc: torch.Tensor, length: int, offset: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Window of ``length`` positions from one document, authors' convention: labels[t] is the
    target at position t, input_ids[t] the token before it. Short windows are padded (label -100)."""
    window = doc[offset:offset + length + 1].long()
    n = window.numel() - 1
    ids = torch.full((length,), PAD, dtype=torch.long)
    labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
    if n > 0:
        ids[:n] = window[:-1]
        labels[:n] = window[1:]
    return ids, labels


class ByteCorpus:
    """Train and validation documents plus deterministic samplers."""

    byte_level = True   # token ids are bytes (the needle task needs text)

    def __init__(self, root: Optional[str] = None, val_fraction: float = 0.05,
                 max_files: Optional[int] = None, docs: Optional[Tuple[Documents, Documents]] = None,
                 suffix: Optional[str] = ".py"):
        self.root = root or stdlib_root()
        if docs is not None:
            self.train, self.val = docs
            return
        files = list_source_files(self.root, suffix)
        if not files:
            raise SystemExit(f"{self.root}: no {'*' + suffix if suffix else ''} files")
        train, val = split_files(files, val_fraction)
        if not val:       # a small directory: still hold one file out
            train, val = train[:-1], train[-1:]
        if not train:
            raise SystemExit(f"{self.root}: needs at least two files (split by file)")
        if max_files:
            train, val = train[:max_files], val[:max(1, max_files // 10)]
        self.train = Documents.from_files(self.root, train)
        self.val = Documents.from_files(self.root, val)

    def summary(self) -> dict:
        return {"root": self.root, "train_files": len(self.train), "val_files": len(self.val),
                "train_tokens": self.train.num_tokens, "val_tokens": self.val.num_tokens}

    def train_batch(self, seed: int, step: int, batch_size: int, seq_len: int):
        """Batch ``step``: files drawn with probability proportional to their length, a uniformly
        random window inside each. A pure function of (seed, step)."""
        rng = np.random.default_rng([seed, step])
        p = self.train.lengths / self.train.lengths.sum()
        docs = rng.choice(len(self.train), size=batch_size, p=p)
        ids, labels = [], []
        for d in docs:
            n = int(self.train.lengths[d])
            offset = int(rng.integers(0, max(1, n - seq_len)))
            x, y = crop(self.train.doc(int(d)), seq_len, offset)
            ids.append(x)
            labels.append(y)
        return torch.stack(ids), torch.stack(labels)

    def eval_windows(self, seq_len: int, num: int, seed: int = 1234):
        """Up to ``num`` validation windows of exactly ``seq_len`` positions, each inside one file
        long enough to hold it, at a random (seeded) offset so that position i carries no
        file-start bias. At most ceil(num / files) windows per file, spread over the files."""
        long_enough = [i for i in range(len(self.val)) if self.val.lengths[i] >= seq_len + 1]
        if not long_enough:
            raise ValueError(f"no validation file holds {seq_len + 1} tokens")
        rng = np.random.default_rng([seed, seq_len])
        order = rng.permutation(long_enough)
        ids, labels, k = [], [], 0
        while len(ids) < num and k < 8 * num:
            d = int(order[k % len(order)])
            k += 1
            n = int(self.val.lengths[d])
            offset = int(rng.integers(0, n - seq_len))
            x, y = crop(self.val.doc(d), seq_len, offset)
            ids.append(x)
            labels.append(y)
        return torch.stack(ids), torch.stack(labels)


class TokenCorpus(ByteCorpus):
    """Pre-tokenized ids (``--tokens FILE``): a .npy array, or raw little-endian uint16/uint32
    (``--token-dtype``). The stream has no document boundaries, so it is cut into fixed chunks
    that play the role of files: the train/validation split is by chunk (a stable hash of the
    chunk index) and windows never cross a chunk boundary. The ids are taken as they are; the
    byte-level specials (BOS/EOS/PAD = 256/257/258) are only used to pad short windows, whose
    labels are ignored."""

    def __init__(self, path: str, dtype: Optional[str] = None, val_fraction: float = 0.05,
                 max_files: Optional[int] = None, chunk_tokens: Optional[int] = None):
        if path.endswith(".npy"):
            arr = np.load(path, mmap_mode="r")
        else:
            if dtype not in ("uint16", "uint32"):
                raise SystemExit(f"{path}: raw token files need --token-dtype uint16 or uint32")
            arr = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
        arr = np.asarray(arr).reshape(-1)
        if arr.size < 2 or not np.issubdtype(arr.dtype, np.integer):
            raise SystemExit(f"{path}: expected a 1-D array of integer token ids")
        if int(arr.min()) < 0 or int(arr.max()) >= 2 ** 31:
            raise SystemExit(f"{path}: token ids out of range")
        self.max_id = int(arr.max())
        n = arr.size
        chunk = chunk_tokens or min(65536, max(1024, n // 20))
        tr_names, va_names = [], []
        for i, s in enumerate(range(0, n, chunk)):
            name = f"chunk{i:06d}"
            (va_names if is_validation(name, val_fraction) else tr_names).append((name, s))
        if not va_names:
            va_names = tr_names[-1:]
            tr_names = tr_names[:-1]
        if not tr_names:
            raise SystemExit(f"{path}: too few tokens ({n}) to split into train and validation")
        if max_files:
            tr_names, va_names = tr_names[:max_files], va_names[:max(1, max_files // 10)]

        def docs(items):
            parts = [np.asarray(arr[s:s + chunk], dtype=np.int32) for _, s in items]
            tokens = torch.from_numpy(np.concatenate(parts))
            lengths = np.asarray([len(p) for p in parts], np.int64)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            return Documents([nm for nm, _ in items], tokens, starts, lengths)

        super().__init__(root=os.path.abspath(path), docs=(docs(tr_names), docs(va_names)))
        self.byte_level = False


def make_corpus(cfg) -> ByteCorpus:
    """The corpus a run config names: ``tokens`` (pre-tokenized file), ``data_dir`` (a directory
    of text files, every file one document, split by file) or the standard library (default)."""
    if cfg.get("tokens"):
        return TokenCorpus(cfg["tokens"], cfg.get("token_dtype"), cfg["val_fraction"],
                           cfg.get("max_files"))
    if cfg.get("data_dir"):
        if not os.path.isdir(cfg["data_dir"]):
            raise SystemExit(f"--data-dir {cfg['data_dir']}: not a directory")
        return ByteCorpus(root=os.path.abspath(cfg["data_dir"]), val_fraction=cfg["val_fraction"],
                          max_files=cfg.get("max_files"), suffix=None)
    return ByteCorpus(val_fraction=cfg["val_fraction"], max_files=cfg.get("max_files"))
