"""smallseq adapter kit: speak `smallseq-worker/1` (docs/worker-protocol.md) from Python.

One file, numpy and safetensors only. An adapter builds an `Adapter` (name, version,
provenance, `Caps`, a `run(case, want)` function) and calls `serve(adapter)`; the kit does the
rest: the handshake, the request loop, error kinds, the atomic output write, and the
conversions every adapter needs between the case file's THD layout (`docs/semantics.md` §1–2)
and what attention APIs take:

- case files: safetensors in bf16 / f16 / f32 (bf16 decoded by bit shifting, no ml_dtypes);
- THD with padded offsets <-> packed tokens (`pack`/`unpack`) and <-> a padded batch
  `[B, S, H, D]` plus lengths (`to_padded`/`from_padded`);
- cu_seqlens <-> segment ids / positions (`segment_ids`, `segment_pos`, `side_from_segments`)
  and TE-style `[1, M]` seqlens / `[1, M+1]` offsets (`te_seqlens_offsets`);
- LSE layouts (`[T,H]`, `[H,T]`, `[B,H,S]`, `[B,S,H]`, trailing 1s, log2) to `[T, H]` f32
  natural log (`lse_to_thd`);
- the visibility mask of §1 per slot or as a padded `[B, Sq, Sk]` boolean mask;
- rounding f64 to bf16 / f16 / f32 exactly once (`round_to_dtype`).

Honesty rules the kit enforces (see docs/adapters.md):
- Don't-care tokens: `unpack`/`from_padded` write 0 (and `lse_to_thd` writes -inf) only at
  tokens the implementation was never asked about; an adapter that hands the whole buffer to
  the implementation returns what the implementation wrote there, untouched.
- Rows with no visible key (§1: O = 0, LSE = -inf): the kit never rewrites O, dQ, dK or dV.
  An adapter declares, once, the LSE value its implementation writes for such a row
  (`Adapter.no_key_lse`: "-inf", "+inf" as flash-attention does, "nan", "0" as PyTorch's
  memory-efficient kernel does, or "underflow", a finite value <= -745 whose exp is 0 even in
  float64, as cuDNN writes; "probe" measures it at start on a case made for it, for
  implementations that document none); in rows that the
  *case* says see no key, exactly that value is mapped to -inf, the same meaning in the
  semantics' convention. Any other value is left alone, so a deviation reaches the campaign
  as a mismatch. The declaration is recorded in the handshake's provenance (`no_key_lse`), and
  `caps.no_key_row` says what O looks like there ("zero", "nan" or "other").

Logs go to stderr only: `serve` moves file descriptor 1 to stderr so that a library printing
to stdout cannot corrupt the protocol stream.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import struct
import sys
import time
import traceback
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

PROTOCOL = "smallseq-worker/1"
DTYPES = ("bf16", "f16", "f32")
MASKS = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
)
OUTPUTS = ("o", "lse", "dq", "dk", "dv")
# dBias (semantics.md §1.9): the gradient of a post-scale bias, [Bb, Hb, Sq, Sk] as the case's
# `bias` tensor; asked for only from adapters that declare `Caps.dbias`.
DBIAS = "dbias"
WANT_NAMES = OUTPUTS + (DBIAS,)
INPUT_NAMES = ("q", "k", "v", "d_o")
OFFSET_NAMES = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
# The bias of semantics.md §1.9: a post-scale tensor [Bb, Hb, Sq, Sk] or ALiBi's slopes [H].
BIAS_NAMES = ("bias", "alibi_slopes")
BIAS_TYPES = ("none", "post_scale_bias", "alibi")
BIAS_SHAPES = ("1hss", "11ss", "b1ss", "bhss")
KNOWN_TENSORS = INPUT_NAMES + OFFSET_NAMES + WANT_NAMES + BIAS_NAMES
CONFIG_KEYS = (
    "dtype",
    "num_heads",
    "num_gqa_groups",
    "head_dim_qk",
    "head_dim_v",
    "mask",
    "window",
    "bias",
    "bias_shape",
    "dropout",
    "dropout_seed",
    "dropout_offset",
    "scale",
    "layout",
)
NO_KEY_LSE = ("-inf", "+inf", "nan", "0", "underflow")
# "underflow": a finite value at most this, whose exp is 0 even in float64 (the smallest
# subnormal is e^-744.4), so every consumer that exponentiates an LSE (a merge of partial
# attentions, a backward's P = exp(S - LSE)) reads it as -inf does. cuDNN writes about -65535.
UNDERFLOW_LSE = -745.0
# Also accepted on adapters' command lines: measure the convention at start (`probe_no_key_lse`).
PROBE = "probe"


# ----------------------------------------------------------------------------------------
# Error kinds (docs/worker-protocol.md, "Error kinds")


class WorkerError(Exception):
    kind = "internal"


class Unsupported(WorkerError):
    """Outside what the implementation computes: the campaign skips with this reason."""

    kind = "unsupported"


class Invalid(WorkerError):
    """The request or the case file is malformed."""

    kind = "invalid"


class DeviceFault(WorkerError):
    """The device or runtime failed; the campaign restarts the worker."""

    kind = "device"


class Internal(WorkerError):
    """A bug in the adapter."""

    kind = "internal"


# Messages that mean the device or its runtime is gone, not that the input was refused.
DEVICE_FAULT_PATTERNS = (
    "illegal memory access",
    "illegal address",
    "device-side assert",
    "unspecified launch failure",
    "cuda error: an illegal",
    "misaligned address",
    "hiperror",
    "out of memory",
    "cudnn_status_execution_failed",
    "cudnn_status_internal_error",
    "cublas_status_execution_failed",
    "xlaruntimeerror: internal",
    "lost device",
    "context is destroyed",
)


@contextmanager
def calling(library: str, device_patterns: Sequence[str] = DEVICE_FAULT_PATTERNS):
    """Wraps a call into the implementation under test.

    An exception raised inside becomes `device` when its message names a device fault, else
    `unsupported` with the library's own message (the library refused the input: the report
    lists the reason). Exceptions outside such a block are adapter bugs (`internal`).
    """
    try:
        yield
    except WorkerError:
        raise
    except Exception as e:  # the library's own exception types vary by version
        text = f"{type(e).__name__}: {e}".strip()
        first = " ".join(text.splitlines()[:3])[:800]
        low = text.lower()
        if any(p in low for p in device_patterns):
            raise DeviceFault(f"{library}: {first}") from e
        raise Unsupported(f"{library}: {first}") from e


# ----------------------------------------------------------------------------------------
# Float formats: decoding, and rounding f64 once to the storage type


_FORMATS = {
    # significand bits (with the implicit one), smallest normal exponent, largest finite
    "bf16": (8, -126, float.fromhex("0x1.fep127")),
    "f16": (11, -14, 65504.0),
    "f32": (24, -126, float.fromhex("0x1.fffffep127")),
    # not a case dtype: what a tensor core's TF32 mode keeps of an f32 operand
    "tf32": (11, -126, float.fromhex("0x1.ffcp127")),
}


def round_to_dtype(x, dtype: str) -> np.ndarray:
    """Rounds to the nearest value of `dtype` (ties to even, overflow to inf, subnormals kept),
    once, from whatever float precision `x` holds, and returns it as f64."""
    if dtype not in _FORMATS:
        raise Internal(f"round_to_dtype: unknown dtype {dtype}")
    x = np.array(x, dtype=np.float64, copy=True)
    p, emin, fmax = _FORMATS[dtype]
    sel = np.isfinite(x) & (x != 0)
    xs = x[sel]
    _, e = np.frexp(xs)  # xs = m * 2**e with 0.5 <= |m| < 1, so the leading bit is 2**(e-1)
    quantum = np.ldexp(1.0, np.maximum(e - 1, emin) - (p - 1))
    r = np.rint(xs / quantum) * quantum  # both scalings are exact: quantum is a power of two
    r = np.where(np.abs(r) > fmax, np.copysign(np.inf, xs), r)
    x[sel] = r
    return x


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) to f32, exactly (NaN payloads, -0.0, subnormals kept)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """f32 values to bf16 bit patterns, rounding to nearest even (NaN stays NaN)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    nan = np.isnan(x)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    quiet = (bits >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(nan, quiet, rounded).astype(np.uint16)


_ST_DTYPES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I32": 4, "I64": 8}


def _decode(dtype: str, shape: List[int], data: bytes, name: str) -> np.ndarray:
    if dtype == "BF16":
        arr = bf16_bits_to_f32(np.frombuffer(data, dtype="<u2"))
    elif dtype == "F16":
        arr = np.frombuffer(data, dtype="<f2")
    elif dtype == "F32":
        arr = np.frombuffer(data, dtype="<f4")
    elif dtype == "F64":
        arr = np.frombuffer(data, dtype="<f8")
    elif dtype == "I32":
        arr = np.frombuffer(data, dtype="<i4")
    elif dtype == "I64":
        arr = np.frombuffer(data, dtype="<i8")
    else:
        raise Invalid(f"tensor {name}: dtype {dtype} is not one the case format uses")
    n = int(np.prod(shape)) if shape else 1
    if arr.size != n:
        raise Invalid(f"tensor {name}: {arr.size} elements for shape {shape}")
    return arr.reshape(shape)


def read_safetensors(path: str) -> Tuple[Dict[str, Tuple[str, np.ndarray]], Dict[str, str]]:
    """Reads a safetensors file: `{name: (dtype, array)}` and the metadata.

    The `safetensors` package validates the layout; the header is read here only for the
    metadata, and decoding is done here so that bf16 needs no extra package."""
    import safetensors

    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise Invalid(f"cannot read {path}: {e.strerror}") from e
    try:
        views = safetensors.deserialize(raw)
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    except Exception as e:
        raise Invalid(f"{path}: not a valid safetensors file: {e}") from e
    meta = header.get("__metadata__") or {}
    out = {}
    for name, view in views:
        out[name] = (view["dtype"], _decode(view["dtype"], list(view["shape"]), bytes(view["data"]), name))
    return out, meta


def encode_tensor(arr: np.ndarray, dtype: str) -> Tuple[str, List[int], bytes]:
    """An array as (safetensors dtype, shape, little-endian bytes); floats are rounded to
    `dtype` ("bf16", "f16", "f32", "f64"), integers to "i32"."""
    shape = list(arr.shape)
    if dtype == "bf16":
        data = f32_to_bf16_bits(round_to_dtype(arr, "bf16").astype(np.float32)).astype("<u2")
        return "BF16", shape, data.tobytes()
    table = {"f16": ("F16", "<f2"), "f32": ("F32", "<f4"), "f64": ("F64", "<f8"), "i32": ("I32", "<i4")}
    if dtype not in table:
        raise Internal(f"encode_tensor: unknown dtype {dtype}")
    st, np_dt = table[dtype]
    # numpy's float casts round to nearest even, overflow to inf and keep subnormals: the
    # same values as `round_to_dtype` (tested), without its frexp/ldexp passes per output.
    return st, shape, np.ascontiguousarray(arr, dtype=np_dt).tobytes()


def write_safetensors(path: str, tensors: Dict[str, Tuple[str, List[int], bytes]], metadata=None):
    """Writes a safetensors file atomically (a temporary name in the same directory, then a
    rename), so a crash never leaves half a file behind a reply."""
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset, blobs = 0, []
    for name in sorted(tensors):
        st, shape, data = tensors[name]
        if len(data) != _ST_DTYPES[st] * int(np.prod(shape) if shape else 1):
            raise Internal(f"tensor {name}: {len(data)} bytes for {st} {shape}")
        header[name] = {"dtype": st, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass(frozen=True)
class Config:
    dtype: str
    num_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    mask: str
    window: Tuple[int, int] = (-1, -1)
    scale: float = 0.0
    bias: str = "none"
    dropout: float = 0.0
    layout: str = "thd"
    # Philox key and counter base of the dropout mask (semantics.md §1.8), 0..2**64-1.
    dropout_seed: int = 0
    dropout_offset: int = 0
    # The broadcast of a post-scale bias (semantics.md §1.9), "" for any other bias.
    bias_shape: str = ""

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def causal(self) -> Optional[str]:
        """None, "top_left" or "bottom_right"."""
        if self.mask in ("causal", "padding_causal"):
            return "top_left"
        if self.mask in ("causal_bottom_right", "padding_causal_bottom_right"):
            return "bottom_right"
        return None

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["num_gqa_groups"] = d.pop("num_kv_heads")
        d["window"] = list(self.window)
        if not self.bias_shape:
            del d["bias_shape"]
        return json.dumps(d)


def parse_config(text: str) -> Config:
    """Parses `smallseq.config` (semantics.md §2): unknown keys and ill-typed values are
    `invalid`, missing optional keys take the defaults."""
    try:
        d = json.loads(text)
    except ValueError as e:
        raise Invalid(f"smallseq.config is not JSON: {e}") from e
    if not isinstance(d, dict):
        raise Invalid("smallseq.config must be a JSON object")
    for k in d:
        if k not in CONFIG_KEYS:
            raise Invalid(f"unknown key {k} in smallseq.config")

    def integer(key):
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 20:
            raise Invalid(f"smallseq.config {key} = {v}: expected an integer in 1..=1048576")
        return v

    def number(key, default):
        v = d.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise Invalid(f"smallseq.config {key} = {v}: expected a finite number")
        return float(v)

    dtype = d.get("dtype")
    if dtype not in DTYPES:
        raise Invalid(f"smallseq.config dtype = {dtype}: expected one of {', '.join(DTYPES)}")
    mask = d.get("mask")
    if mask not in MASKS:
        raise Invalid(f"smallseq.config mask = {mask}: expected one of {', '.join(MASKS)}")
    h, hkv = integer("num_heads"), integer("num_gqa_groups")
    if h % hkv:
        raise Invalid(f"smallseq.config num_gqa_groups = {hkv} does not divide num_heads = {h}")
    dqk, dv = integer("head_dim_qk"), integer("head_dim_v")
    w = d.get("window", [-1, -1])
    if (
        not isinstance(w, list)
        or len(w) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in w)
    ):
        raise Invalid(f"smallseq.config window = {w}: expected [left, right], integers >= -1")
    bias = d.get("bias", "none")
    if not isinstance(bias, str):
        raise Invalid(f"smallseq.config bias = {bias}: expected a string")
    bias_shape = d.get("bias_shape", "1hss" if bias == "post_scale_bias" else None)
    if bias != "post_scale_bias" and bias_shape is not None:
        raise Invalid(f"smallseq.config bias_shape = {bias_shape}: only bias = post_scale_bias has a shape")
    if bias == "post_scale_bias" and bias_shape not in BIAS_SHAPES:
        raise Invalid(f"smallseq.config bias_shape = {bias_shape}: expected one of {', '.join(BIAS_SHAPES)}")
    dropout = number("dropout", 0.0)
    if not 0.0 <= dropout <= 1.0:
        raise Invalid(f"smallseq.config dropout = {dropout}: must be in [0, 1]")

    def word64(key):
        v = d.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 64:
            raise Invalid(f"smallseq.config {key} = {v}: expected an integer in 0..=18446744073709551615")
        return v

    seed, offset = word64("dropout_seed"), word64("dropout_offset")
    layout = d.get("layout", "thd")
    if layout not in ("thd", "bshd"):
        raise Invalid(f"smallseq.config layout = {layout}: expected thd or bshd")
    scale = number("scale", 1.0 / math.sqrt(dqk))
    return Config(dtype, h, hkv, dqk, dv, mask, (w[0], w[1]), scale, bias, dropout, layout, seed, offset,
                  bias_shape or "")


@dataclasses.dataclass(frozen=True)
class Side:
    """One side (q or kv) of a THD layout."""

    cu: np.ndarray  # [b+1] prefix sums of the actual lengths
    offsets: np.ndarray  # [b+1] start token of each slot (cu_seqlens_*_padded, or cu)
    tokens: int  # rows of the buffer (T)
    padded: bool  # whether cu_seqlens_*_padded was given

    @property
    def slots(self) -> int:
        return len(self.cu) - 1

    # Cached: conversions read these once per slot, and a side never changes (frozen).
    @functools.cached_property
    def lens(self) -> np.ndarray:
        return np.diff(self.cu)

    @property
    def starts(self) -> np.ndarray:
        return self.offsets[:-1]

    @property
    def max_len(self) -> int:
        return int(self.lens.max()) if self.slots else 0

    @property
    def max_span(self) -> int:
        return int(np.diff(self.offsets).max()) if self.slots else 0

    @property
    def has_gaps(self) -> bool:
        """Tokens between slots (padded offsets that differ from cu_seqlens)."""
        return bool(np.any(self.offsets != self.cu))

    def token_index(self) -> np.ndarray:
        """Buffer rows of the valid tokens, slot by slot (the packed order)."""
        return self._token_index.copy()

    @functools.cached_property
    def _token_index(self) -> np.ndarray:
        if not self.slots:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(o, o + n) for o, n in zip(self.starts, self.lens)])

    def valid(self) -> np.ndarray:
        """[T] bool: valid tokens; every other row is a don't-care token."""
        return self._valid.copy()

    @functools.cached_property
    def _valid(self) -> np.ndarray:
        m = np.zeros(self.tokens, dtype=bool)
        m[self._token_index] = True
        return m


def make_side(cu, offsets=None, tokens=None, which: str = "") -> Side:
    """A validated side from `cu_seqlens` (and padded offsets); `tokens` defaults to the end
    of the last slot; `which` ("q", "kv") names the fields in errors. Violations are
    `invalid`, naming the field, index and value."""
    cu = np.asarray(cu, dtype=np.int64)
    padded = offsets is not None
    off = np.asarray(offsets, dtype=np.int64) if padded else cu
    cu_name = "cu_seqlens" + (f"_{which}" if which else "")
    name = cu_name + ("_padded" if padded else "")
    if cu.ndim != 1 or cu.size == 0:
        raise Invalid(f"{cu_name}: shape {list(cu.shape)}, expected [b+1]")
    if off.shape != cu.shape:
        raise Invalid(f"{name}: shape {list(off.shape)}, expected {list(cu.shape)} like {cu_name}")
    if cu[0] != 0:
        raise Invalid(f"{cu_name}[0] = {cu[0]}, expected 0")
    if off[0] < 0:
        raise Invalid(f"{name}[0] = {off[0]} is negative")
    for arr, n in ((cu, cu_name), (off, name)):
        bad = np.nonzero(np.diff(arr) < 0)[0]
        if bad.size:
            i = int(bad[0]) + 1
            raise Invalid(f"{n}[{i}] = {arr[i]} is below {n}[{i-1}] = {arr[i-1]}")
    short = np.nonzero(np.diff(off) < np.diff(cu))[0]
    if short.size:
        i = int(short[0])
        raise Invalid(f"slot {i}: length {cu[i+1]-cu[i]} in {cu_name} exceeds its span {off[i+1]-off[i]} in {name}")
    tokens = int(off[-1]) if tokens is None else int(tokens)
    if off[-1] > tokens:
        raise Invalid(f"{name}[{cu.size-1}] = {off[-1]} is past the buffer of {tokens} tokens")
    return Side(cu, off, tokens, padded)


@dataclasses.dataclass
class Case:
    config: Config
    q: np.ndarray  # [Tq, H, Dqk] f32 holding values exact in config.dtype
    k: np.ndarray  # [Tk, Hkv, Dqk]
    v: np.ndarray  # [Tk, Hkv, Dv]
    d_o: Optional[np.ndarray]  # [Tq, H, Dv] or None (forward-only case)
    sq: Side
    skv: Side
    meta: Dict[str, str]
    # semantics.md §1.9: bias [Bb, Hb, Sq, Sk] f32 (post_scale_bias) or slopes [H] f32 (alibi)
    bias: Optional[np.ndarray] = None
    alibi_slopes: Optional[np.ndarray] = None

    @property
    def backward(self) -> bool:
        return self.d_o is not None

    def bias_of(self, slot: int) -> np.ndarray:
        """[H, Lq, Lk] f64: what semantics.md §1.9 adds to slot `slot`'s scores after the scale
        (0 without a bias; -inf hides a key)."""
        c = self.config
        lq, lk = int(self.sq.lens[slot]), int(self.skv.lens[slot])
        if self.bias is not None:
            b = slot if self.bias.shape[0] > 1 else 0
            t = self.bias[b, :, :lq, :lk].astype(np.float64)
            return np.broadcast_to(t, (c.num_heads, lq, lk))
        if self.alibi_slopes is not None:
            r = np.arange(lq)[:, None]
            col = np.arange(lk)[None, :]
            dist = np.abs(r + (lk - lq) - col).astype(np.float64)
            return -self.alibi_slopes.astype(np.float64)[:, None, None] * dist[None]
        return np.zeros((c.num_heads, lq, lk))

    def visible(self, slot: int) -> np.ndarray:
        """[Lq, Lk] bool: which keys each query row of `slot` sees (semantics.md §1)."""
        return visibility(self.config, int(self.sq.lens[slot]), int(self.skv.lens[slot]))

    def no_key_rows(self) -> np.ndarray:
        """[Tq] bool: valid query tokens that see no key (their O = 0, LSE = -inf)."""
        rows = np.zeros(self.sq.tokens, dtype=bool)
        for i in range(self.sq.slots):
            lq = int(self.sq.lens[i])
            if lq:
                o = int(self.sq.starts[i])
                rows[o : o + lq] = ~self.visible(i).any(axis=1)
        return rows

    def padded_mask(self, sq: Optional[int] = None, sk: Optional[int] = None) -> np.ndarray:
        """[B, Sq, Sk] bool, True = attend: the §1 mask of each slot in a padded batch (rows
        and columns past a slot's lengths are False)."""
        sq = self.sq.max_len if sq is None else sq
        sk = self.skv.max_len if sk is None else sk
        m = np.zeros((self.sq.slots, sq, sk), dtype=bool)
        for i in range(self.sq.slots):
            lq, lk = int(self.sq.lens[i]), int(self.skv.lens[i])
            m[i, :lq, :lk] = self.visible(i)
        return m


def visibility(cfg: Config, lq: int, lk: int) -> np.ndarray:
    """[lq, lk] bool, key c visible to row r (semantics.md §1, windows bottom-right aligned)."""
    r = np.arange(lq)[:, None]
    c = np.arange(lk)[None, :]
    diag = r + (lk - lq)
    vis = np.ones((lq, lk), dtype=bool)
    if cfg.causal == "top_left":
        vis &= c <= r
    elif cfg.causal == "bottom_right":
        vis &= c <= diag
    left, right = cfg.window
    if left >= 0:
        vis &= c >= diag - left
    if right >= 0:
        vis &= c <= diag + right
    return vis


def read_case(path: str) -> Case:
    """Reads and validates a case file (semantics.md §2). Problems are `invalid`; dropout,
    which this kit's adapters do not compute, and a bias type §1.9 does not define are
    `unsupported` (§3.5); a post-scale bias or ALiBi is read, and `Caps.bias` decides."""
    tensors, meta = read_safetensors(path)
    if meta.get("smallseq.format") != "1":
        raise Invalid(f"{path}: smallseq.format = {meta.get('smallseq.format')}, this kit reads 1")
    if "smallseq.config" not in meta:
        raise Invalid(f"{path}: metadata smallseq.config is missing")
    cfg = parse_config(meta["smallseq.config"])
    for name in tensors:
        if name not in KNOWN_TENSORS:
            raise Invalid(f"{path}: unknown tensor {name}")
    want_st = {"bf16": "BF16", "f16": "F16", "f32": "F32"}[cfg.dtype]

    def inp(name, heads, dim):
        if name not in tensors:
            raise Invalid(f"tensor {name} is missing")
        st, arr = tensors[name]
        if st != want_st:
            raise Invalid(f"tensor {name}: dtype {st}, expected {want_st} (config dtype {cfg.dtype})")
        if arr.ndim == 4 and cfg.layout == "bshd":
            arr = arr.reshape(arr.shape[0] * arr.shape[1], arr.shape[2], arr.shape[3])
        if arr.ndim != 3 or arr.shape[1:] != (heads, dim):
            raise Invalid(f"tensor {name}: shape {list(arr.shape)}, expected [T, {heads}, {dim}]")
        return np.ascontiguousarray(arr, dtype=np.float32)

    q = inp("q", cfg.num_heads, cfg.head_dim_qk)
    k = inp("k", cfg.num_kv_heads, cfg.head_dim_qk)
    v = inp("v", cfg.num_kv_heads, cfg.head_dim_v)
    d_o = inp("d_o", cfg.num_heads, cfg.head_dim_v) if "d_o" in tensors else None
    if k.shape[0] != v.shape[0]:
        raise Invalid(f"tensor v: {v.shape[0]} tokens, k has {k.shape[0]}")
    if d_o is not None and d_o.shape[0] != q.shape[0]:
        raise Invalid(f"tensor d_o: {d_o.shape[0]} tokens, q has {q.shape[0]}")

    def offsets(name):
        if name not in tensors:
            return None
        st, arr = tensors[name]
        if st != "I32" or arr.ndim != 1:
            raise Invalid(f"tensor {name}: {st} {list(arr.shape)}, expected I32 [b+1]")
        return arr

    def side(which, tokens):
        cu = offsets(f"cu_seqlens_{which}")
        if cu is None:
            raise Invalid(f"tensor cu_seqlens_{which} is missing")
        return make_side(cu, offsets(f"cu_seqlens_{which}_padded"), tokens, which)

    sq, skv = side("q", q.shape[0]), side("kv", k.shape[0])
    if sq.slots != skv.slots:
        raise Invalid(f"cu_seqlens_kv has {skv.slots + 1} entries, cu_seqlens_q has {sq.slots + 1}")
    bias, slopes = read_bias(tensors, cfg, sq, skv, want_st)
    if cfg.dropout != 0.0:
        # The mask is defined (semantics.md §1.8), but no adapter passes it to its framework yet.
        raise Unsupported(f"dropout = {cfg.dropout}: this kit's adapters do not compute dropout")
    if cfg.bias not in BIAS_TYPES:
        raise Unsupported(f"bias = {cfg.bias} is outside semantics §1.9")
    case = Case(cfg, q, k, v, d_o, sq, skv, dict(meta), bias, slopes)
    check_bias_entries(case)
    return case


def read_bias(tensors, cfg: Config, sq: "Side", skv: "Side", want_st: str):
    """The bias tensors the config names (semantics.md §2.1), shapes checked; `invalid` for a
    tensor the config does not name."""
    want = {"post_scale_bias": "bias", "alibi": "alibi_slopes"}.get(cfg.bias)
    for name in BIAS_NAMES:
        if name in tensors and name != want:
            raise Invalid(f"tensor {name}: present, but smallseq.config has bias = {cfg.bias}")
    if want is None:
        return None, None
    if want not in tensors:
        raise Invalid(f"tensor {want} is missing (bias = {cfg.bias})")
    st, arr = tensors[want]
    if want == "alibi_slopes":
        if st != "F32" or arr.shape != (cfg.num_heads,):
            raise Invalid(f"tensor alibi_slopes: {st} {list(arr.shape)}, expected F32 [{cfg.num_heads}]")
        bad = np.flatnonzero(~np.isfinite(arr))
        if len(bad):
            raise Invalid(f"tensor alibi_slopes[{bad[0]}] = {arr[bad[0]]}: must be finite")
        return None, np.asarray(arr, dtype=np.float32)
    if st != want_st:
        raise Invalid(f"tensor bias: dtype {st}, expected {want_st} (config dtype {cfg.dtype})")
    bb = sq.slots if cfg.bias_shape[0] == "b" else 1
    hb = cfg.num_heads if cfg.bias_shape[1] == "h" else 1
    if arr.ndim != 4 or arr.shape[:2] != (bb, hb) or arr.shape[2] < sq.max_len or arr.shape[3] < skv.max_len:
        raise Invalid(f"tensor bias: shape {list(arr.shape)}, expected [{bb}, {hb}, >= {sq.max_len}, "
                      f">= {skv.max_len}] (bias_shape = {cfg.bias_shape})")
    return np.asarray(arr, dtype=np.float32), None


def check_bias_entries(case: "Case"):
    """`invalid` for a +inf or NaN bias entry that a slot reads at a visible key (semantics.md
    §1.9), naming the tensor, the index and the value."""
    if case.bias is None:
        return
    for i in range(case.sq.slots):
        lq, lk = int(case.sq.lens[i]), int(case.skv.lens[i])
        b = i if case.bias.shape[0] > 1 else 0
        t = case.bias[b, :, :lq, :lk]
        bad = np.argwhere((np.isnan(t) | (t == np.inf)) & case.visible(i)[None])
        if len(bad):
            h, r, col = (int(x) for x in bad[0])
            raise Invalid(f"tensor bias[{b}, {h}, {r}, {col}] = {t[h, r, col]}: slot {i} reads it at a "
                          "visible key, where +inf or NaN leaves the softmax undefined")


def write_case(path: str, case: Case, outputs: Optional[Dict[str, np.ndarray]] = None):
    """Writes a case file (inputs in the config dtype, outputs as f32); used by tests and by
    adapter authors to build a case by hand."""
    cfg = case.config
    t = {}
    for name in INPUT_NAMES:
        arr = getattr(case, name)
        if arr is not None:
            t[name] = encode_tensor(arr, cfg.dtype)
    if case.bias is not None:
        t["bias"] = encode_tensor(case.bias, cfg.dtype)
    if case.alibi_slopes is not None:
        t["alibi_slopes"] = encode_tensor(case.alibi_slopes, "f32")
    t["cu_seqlens_q"] = encode_tensor(case.sq.cu, "i32")
    t["cu_seqlens_kv"] = encode_tensor(case.skv.cu, "i32")
    if case.sq.padded:
        t["cu_seqlens_q_padded"] = encode_tensor(case.sq.offsets, "i32")
    if case.skv.padded:
        t["cu_seqlens_kv_padded"] = encode_tensor(case.skv.offsets, "i32")
    for name, arr in (outputs or {}).items():
        t[name] = encode_tensor(arr, "f32")
    meta = dict(case.meta)
    meta.update({"smallseq.format": "1", "smallseq.config": cfg.to_json()})
    write_safetensors(path, t, meta)


# ----------------------------------------------------------------------------------------
# Layout conversions


def pack(x: np.ndarray, side: Side) -> np.ndarray:
    """[T, ...] -> [sum L, ...]: the valid tokens, slot after slot, without gaps or tail."""
    return x[side.token_index()]


def packed_cu(side: Side) -> np.ndarray:
    """int32 cu_seqlens of the packed buffer (equal to `side.cu`)."""
    return side.cu.astype(np.int32)


def unpack(y: np.ndarray, side: Side, fill: float = 0.0) -> np.ndarray:
    """[sum L, ...] -> [T, ...]: scatter back; don't-care tokens, which the implementation
    never saw, get `fill` (0 for O/dQ/dK/dV, -inf for LSE)."""
    out = np.full((side.tokens,) + y.shape[1:], fill, dtype=np.float32)
    out[side.token_index()] = y
    return out


def to_padded(x: np.ndarray, side: Side, s: Optional[int] = None, pad: str = "zero") -> np.ndarray:
    """[T, H, D] -> [B, S, H, D], row b holding slot b's tokens at 0..L_b.

    `pad` says what fills row b past L_b: "zero", or "span" to carry the slot's own
    pad-between-seqs tokens (buffer rows off_b + j < off_{b+1}) and zero past its span, so
    that whatever the campaign put into don't-care tokens (NaN, Inf) reaches the
    implementation's padding positions, where a correct kernel must ignore it."""
    s = side.max_len if s is None else s
    if s < side.max_len:
        raise Internal(f"to_padded: S = {s} is below the longest slot {side.max_len}")
    out = np.zeros((side.slots, s) + x.shape[1:], dtype=x.dtype)
    for b in range(side.slots):
        o, n = int(side.starts[b]), int(side.lens[b])
        end = n if pad == "zero" else min(s, int(side.offsets[b + 1]) - o)
        out[b, :end] = x[o : o + end]
    return out


def from_padded(y: np.ndarray, side: Side, fill: float = 0.0) -> np.ndarray:
    """[B, S, ...] -> [T, ...]: slot b's first L_b rows go back to their tokens; the padded
    batch's own pad rows are dropped and don't-care tokens get `fill`."""
    out = np.full((side.tokens,) + y.shape[2:], fill, dtype=np.float32)
    for b in range(side.slots):
        o, n = int(side.starts[b]), int(side.lens[b])
        out[o : o + n] = y[b, :n]
    return out


def from_padded_outputs(case: "Case", res: Dict[str, np.ndarray], lse_layout: str = "bhs") -> Dict[str, np.ndarray]:
    """A padded batch's outputs (o, dq `[B, Sq, ...]`; dk, dv `[B, Sk, ...]`; lse in
    `lse_layout`) back to the case's THD tensors, with `from_padded` / `lse_to_thd`."""
    out = {}
    for name, arr in res.items():
        if name == "lse":
            out[name] = lse_to_thd(arr, case.sq, lse_layout)
        else:
            out[name] = from_padded(arr, case.sq if name in ("o", "dq") else case.skv)
    return out


def no_query_outputs(case: "Case") -> Dict[str, np.ndarray]:
    """The outputs of a case without a single query token (b = 0 or only empty query slots):
    nothing to launch, every output is the zero-out value of semantics §1 (and dBias, with a
    post-scale bias, 0: no slot reads an entry)."""
    c = case.config
    tq, tk = case.sq.tokens, case.skv.tokens
    out = {
        "o": np.zeros((tq, c.num_heads, c.head_dim_v)),
        "lse": np.full((tq, c.num_heads), -np.inf),
        "dq": np.zeros((tq, c.num_heads, c.head_dim_qk)),
        "dk": np.zeros((tk, c.num_kv_heads, c.head_dim_qk)),
        "dv": np.zeros((tk, c.num_kv_heads, c.head_dim_v)),
    }
    if case.bias is not None:
        out[DBIAS] = np.zeros(case.bias.shape)
    return out


def segment_ids(side: Side) -> np.ndarray:
    """[T] int32, TE/JAX style: 1 + slot index on valid tokens, 0 on don't-care tokens.
    Slots of length 0 leave no trace (segment ids cannot express them)."""
    ids = np.zeros(side.tokens, dtype=np.int32)
    for b in range(side.slots):
        o, n = int(side.starts[b]), int(side.lens[b])
        ids[o : o + n] = b + 1
    return ids


def segment_pos(side: Side) -> np.ndarray:
    """[T] int32: position of each valid token within its slot, 0 on don't-care tokens."""
    pos = np.zeros(side.tokens, dtype=np.int32)
    for b in range(side.slots):
        o, n = int(side.starts[b]), int(side.lens[b])
        pos[o : o + n] = np.arange(n)
    return pos


def side_from_segments(ids: np.ndarray) -> Side:
    """The inverse of `segment_ids` for slots of length >= 1 with ids 1..b in buffer order:
    gaps after a segment become its padded span; the last slot ends at its last token (the
    rest of the buffer is tail slack)."""
    ids = np.asarray(ids)
    b = int(ids.max()) if ids.size else 0
    lens, starts = [], []
    for s in range(1, b + 1):
        where = np.nonzero(ids == s)[0]
        if where.size == 0:
            raise Invalid(f"segment ids: segment {s} has no token (slots of length 0 are not expressible)")
        if where[-1] - where[0] + 1 != where.size:
            raise Invalid(f"segment ids: segment {s} is not contiguous")
        if starts and where[0] < starts[-1]:
            raise Invalid(f"segment ids: segment {s} starts before segment {s - 1}")
        lens.append(where.size)
        starts.append(int(where[0]))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    off = np.array(starts + [starts[-1] + lens[-1] if b else 0], dtype=np.int64)
    padded = bool(np.any(off != cu))
    return make_side(cu, off if padded else None, ids.size)


def te_seqlens_offsets(side: Side, max_segments: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """TE `SequenceDescriptor.from_seqlens_and_offsets` arrays for the whole buffer as one
    row: seqlens `[1, M]` and offsets `[1, M+1]` (int32, -1 in unused entries), where
    offsets include the end of the last slot's span."""
    m = side.slots if max_segments is None else max_segments
    if m < side.slots:
        raise Internal(f"te_seqlens_offsets: {side.slots} slots exceed max_segments {m}")
    seqlens = np.full((1, m), -1, dtype=np.int32)
    offsets = np.full((1, m + 1), -1, dtype=np.int32)
    seqlens[0, : side.slots] = side.lens
    offsets[0, : side.slots + 1] = side.offsets
    return seqlens, offsets


# ----------------------------------------------------------------------------------------
# LSE


def lse_to_thd(lse, side: Side, layout: str, base: str = "e", packed: bool = False) -> np.ndarray:
    """An implementation's LSE to `[T, H]` f32, natural log, -inf at don't-care tokens.

    `layout` names the axes of `lse` (trailing size-1 axes are dropped first):
    "th" / "ht" with the token axis over the whole buffer (or, with `packed=True`, over the
    packed valid tokens); "bhs" / "bsh" for a padded batch (S >= the longest slot, e.g. the
    32-rounded S of memory-efficient attention). `base` "2" converts a log2 LSE."""
    a = np.asarray(lse, dtype=np.float64)
    while a.ndim > 2 and a.shape[-1] == 1 and layout in ("th", "ht"):
        a = a[..., 0]
    while a.ndim > 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if layout in ("th", "ht"):
        if a.ndim != 2:
            raise Internal(f"lse_to_thd: shape {list(np.shape(lse))} is not {layout}")
        th = a if layout == "th" else a.T
        n = side.cu[-1] if packed else side.tokens
        if th.shape[0] < n:
            raise Internal(f"lse_to_thd: {th.shape[0]} tokens, expected {n}")
        th = th[:n]
        out = unpack(th, side, -np.inf) if packed else np.where(side.valid()[:, None], th, -np.inf)
    elif layout in ("bhs", "bsh"):
        if a.ndim != 3:
            raise Internal(f"lse_to_thd: shape {list(np.shape(lse))} is not {layout}")
        bsh = a if layout == "bsh" else a.transpose(0, 2, 1)
        if bsh.shape[0] != side.slots or bsh.shape[1] < side.max_len:
            raise Internal(f"lse_to_thd: shape {list(np.shape(lse))} does not hold {side.slots} slots of up to {side.max_len}")
        out = from_padded(bsh, side, -np.inf)
    else:
        raise Internal(f"lse_to_thd: unknown layout {layout}")
    if base == "2":
        out = out * math.log(2.0)
    elif base != "e":
        raise Internal(f"lse_to_thd: unknown base {base}")
    return np.asarray(out, dtype=np.float32)


def map_no_key_lse(lse: np.ndarray, no_key: np.ndarray, convention: Optional[str]) -> Tuple[np.ndarray, int]:
    """In rows the case says see no key, replaces exactly the declared convention value
    ("+inf", "nan", "0", or with "underflow" every value <= UNDERFLOW_LSE) by -inf; returns the LSE and how many entries were mapped. Every other
    value, there or elsewhere, is left as the implementation wrote it."""
    if convention is None or convention == "-inf":
        return lse, 0
    if convention == "+inf":
        hit = np.isposinf(lse)
    elif convention == "nan":
        hit = np.isnan(lse)
    elif convention == "0":
        hit = lse == 0
    elif convention == "underflow":
        hit = lse <= UNDERFLOW_LSE
    else:
        raise Internal(f"no_key_lse = {convention}: expected one of {', '.join(NO_KEY_LSE)}")
    hit &= no_key[:, None]
    out = lse.copy()
    out[hit] = -np.inf
    return out, int(hit.sum())


def no_key_probe_case(dtype: str = "bf16", head_dim: int = 64) -> "Case":
    """A case whose first two query rows see no key: one slot, 4 queries, 2 keys,
    bottom-right causal (row r sees keys c <= r - 2). The other rows see one or two keys."""
    rng = np.random.default_rng(0)
    cfg = Config(dtype, 1, 1, head_dim, head_dim, "causal_bottom_right", (-1, -1), 1.0 / math.sqrt(head_dim))

    def x(n):
        return round_to_dtype(rng.standard_normal((n, 1, head_dim)), dtype).astype(np.float32)

    sq, skv = make_side(np.array([0, 4])), make_side(np.array([0, 2]))
    return Case(cfg, x(4), x(2), x(2), None, sq, skv, {"smallseq.seed": "0"})


def classify_no_key_lse(values) -> str:
    """The convention (one of `NO_KEY_LSE`) that every value in `values` (the LSE an
    implementation wrote in rows with no visible key) follows; `Internal` when they follow
    none, or not the same one: such an implementation has no convention to declare."""
    v = np.asarray(values, dtype=np.float64).ravel()
    tests = (("-inf", np.isneginf), ("+inf", np.isposinf), ("nan", np.isnan), ("0", lambda a: a == 0),
             ("underflow", lambda a: np.isfinite(a) & (a <= UNDERFLOW_LSE)))
    for name, test in tests:
        if v.size and bool(np.all(test(v))):
            return name
    raise Internal(f"no single no-key LSE convention: rows without keys hold {', '.join(repr(float(a)) for a in v[:8])}")


def probe_no_key_lse(run: "RunFn", dtype: str = "bf16", head_dim: int = 64) -> Tuple[str, np.ndarray]:
    """Runs `run` on `no_key_probe_case` and returns the convention its no-key rows follow
    (and the values they held),
    for an implementation whose convention is documented nowhere (cuDNN): measured once at
    start, declared in the handshake, and then mapped exactly like a declared one."""
    case = no_key_probe_case(dtype, head_dim)
    out = run(case, frozenset(["o", "lse"]))
    seen = np.asarray(out["lse"], dtype=np.float64)[case.no_key_rows()].ravel()
    return classify_no_key_lse(seen), seen


# ----------------------------------------------------------------------------------------
# Capabilities and the adapter object


@dataclasses.dataclass
class Caps:
    dtypes: List[str] = dataclasses.field(default_factory=list)
    # the kit hands a BSHD case to `run` as THD (every slot S tokens), so both by default
    layouts: List[str] = dataclasses.field(default_factory=lambda: ["thd", "bshd"])
    masks: List[str] = dataclasses.field(default_factory=list)
    window: bool = False
    gqa: bool = False
    dv_ne_dqk: bool = False
    head_dims: Optional[List[int]] = None
    max_tokens: Optional[int] = None
    backward: bool = False
    lse: bool = False
    padded_offsets: bool = False
    reports_path: bool = False
    reports_workspace: bool = False
    follows_small_seq_roundings: bool = False
    harness_options: bool = False
    no_key_row: str = "zero"
    arch: Optional[str] = None
    small_seq: bool = False  # whether `arch` has a small-seq kernel (read with `arch`)
    devices: int = 1
    dropout: bool = False  # computes the Philox dropout of semantics.md §1.8
    bias: bool = False  # computes semantics.md §1.9's post-scale bias and ALiBi
    # returns dBias of a post-scale bias (semantics.md §1.9) when a request's want names "dbias"
    dbias: bool = False
    # the numeric design the implementation follows (docs/judgement.md, "Declared designs"): "project" holds it
    # to smallseq's own roundings; None (undeclared) judges it against every common design
    design: Optional[str] = None
    # the outputs whose bits may differ between runs of the same inputs (docs/worker-protocol.md,
    # caps.nondeterministic): `determinism` holds their reruns to tolerance instead of to their
    # bits, the other outputs keep the bitwise rule; `nondeterministic_note` says why (quoted by
    # triage). E.g. Caps(nondeterministic=("dq",), nondeterministic_note="dq summed with atomics")
    nondeterministic: Sequence[str] = ()
    nondeterministic_note: Optional[str] = None
    # the least time one call may take, in seconds (docs/worker-protocol.md,
    # caps.case_timeout_s): an implementation that compiles each new shape (JAX's XLA) declares
    # it, and the campaign's default case timeout never goes below it
    case_timeout_s: Optional[float] = None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        if d["design"] is None:
            del d["design"]
        # absent when empty: the handshake of an adapter that declares nothing is unchanged
        unknown = [t for t in self.nondeterministic if t not in OUTPUTS + ("dbias",)]
        if unknown:
            raise ValueError(f"Caps.nondeterministic: {unknown} are not output names {list(OUTPUTS) + ['dbias']}")
        if self.nondeterministic:
            d["nondeterministic"] = list(self.nondeterministic)
        else:
            del d["nondeterministic"]
        if d["nondeterministic_note"] is None:
            del d["nondeterministic_note"]
        if d["case_timeout_s"] is None:
            del d["case_timeout_s"]
        elif not 0 < d["case_timeout_s"] <= 86400:
            raise ValueError(f"Caps.case_timeout_s: {d['case_timeout_s']} is not seconds in (0, 86400]")
        return d

    def outside(self, case: Case) -> Optional[str]:
        """Why `case` is outside these capabilities, or None."""
        c = case.config
        checks = [
            (c.dtype not in self.dtypes, f"dtype {c.dtype}"),
            (c.layout not in self.layouts, f"layout {c.layout}"),
            (c.mask not in self.masks, f"mask {c.mask}"),
            (c.window != (-1, -1) and not self.window, f"window {list(c.window)}"),
            (c.num_kv_heads != c.num_heads and not self.gqa, "num_gqa_groups < num_heads"),
            (c.head_dim_v != c.head_dim_qk and not self.dv_ne_dqk, "head_dim_v != head_dim_qk"),
            (
                self.head_dims is not None
                and (c.head_dim_qk not in self.head_dims or c.head_dim_v not in self.head_dims),
                f"head dims {c.head_dim_qk}/{c.head_dim_v}",
            ),
            (
                self.max_tokens is not None and max(case.sq.tokens, case.skv.tokens) > self.max_tokens,
                f"more than {self.max_tokens} tokens",
            ),
            ((case.sq.padded or case.skv.padded) and not self.padded_offsets, "padded offsets"),
            (c.dropout != 0.0 and not self.dropout, f"dropout {c.dropout}"),
            (c.bias != "none" and not self.bias, f"bias {c.bias}"),
        ]
        for bad, what in checks:
            if bad:
                return f"{what} is outside the declared capabilities"
        return None


RunFn = Callable[[Case, frozenset], Dict[str, np.ndarray]]


@dataclasses.dataclass
class Adapter:
    """What `serve` needs: the handshake's fields and the function computing one case.

    `run(case, want)` returns a dict with the wanted names among o `[Tq,H,Dv]`,
    lse `[Tq,H]` (natural log; `lse_to_thd` converts), dq, dk, dv, and dbias `[Bb,Hb,Sq,Sk]`
    (the shape of `case.bias`; wanted only from an adapter declaring `Caps.dbias`, on a case
    with a post-scale bias and a d_o). `setup`, if given, runs once before the handshake
    (import the framework there, after the kit has taken stdout)."""

    name: str
    version: str
    caps: Caps
    run: RunFn
    provenance: Dict[str, str] = dataclasses.field(default_factory=dict)
    no_key_lse: Optional[str] = "-inf"
    setup: Optional[Callable[["Adapter"], None]] = None


def output_shapes(case: Case) -> Dict[str, Tuple[int, ...]]:
    """The shape of each output `case` has (semantics.md §2.1): dbias only with a post-scale
    bias, as its `bias` tensor is ([Bb, Hb, Sq, Sk], Sq and Sk as stored)."""
    c = case.config
    tq, tk = case.sq.tokens, case.skv.tokens
    shapes = {
        "o": (tq, c.num_heads, c.head_dim_v),
        "lse": (tq, c.num_heads),
        "dq": (tq, c.num_heads, c.head_dim_qk),
        "dk": (tk, c.num_kv_heads, c.head_dim_qk),
        "dv": (tk, c.num_kv_heads, c.head_dim_v),
    }
    if case.bias is not None:
        shapes[DBIAS] = tuple(case.bias.shape)
    return shapes


def no_dbias_reason(case: Case) -> str:
    """Why `case` has no dBias to return (its bias is not a post-scale tensor)."""
    if case.config.bias == "alibi":
        return "the case's bias is alibi, whose slopes take no gradient (semantics.md §1.9)"
    return f"the case has no post_scale_bias (bias = {case.config.bias})"


def finish_outputs(case: Case, produced: Dict[str, np.ndarray], want: Iterable[str], adapter: Adapter):
    """Checks the adapter's outputs against the case's shapes and maps the declared no-key
    LSE convention; returns the tensors to write and how many LSE entries were mapped."""
    shapes = output_shapes(case)
    out, mapped = {}, 0
    for name in want:
        if name not in shapes:
            raise Invalid(f"want names {name}, but {no_dbias_reason(case)}")
        if name not in produced:
            raise Internal(f"the adapter did not produce {name}")
        arr = np.asarray(produced[name])
        if arr.shape != shapes[name]:
            raise Internal(f"output {name}: shape {list(arr.shape)}, expected {list(shapes[name])}")
        if name == "lse":
            arr, mapped = map_no_key_lse(arr.astype(np.float32), case.no_key_rows(), adapter.no_key_lse)
        out[name] = arr
    return out, mapped


# ----------------------------------------------------------------------------------------
# The protocol loop


def arg_parser(doc: str, no_key_lse: Optional[str] = "-inf"):
    """An argument parser for an adapter's command line, with the options every adapter has:
    `--no-key-lse`, the LSE value its implementation writes in a row with no visible key
    (or `probe`: measured at start by `probe_no_key_lse`), and
    `--devices N`, declared as `caps.devices` (the campaign then starts a worker per device
    with CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES set to it)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--no-key-lse", default=no_key_lse, choices=NO_KEY_LSE + (PROBE,))
    ap.add_argument("--devices", type=int, default=1)
    return ap


def log(msg: str):
    print(f"[adapter] {msg}", file=sys.stderr, flush=True)


_PROTOCOL_STREAM = None


def protocol_stream():
    """The protocol stream: a private duplicate of fd 1, taken once, after which fd 1 (and
    sys.stdout) point at stderr, so nothing else can write to it. `serve` writes its lines
    here; `write_line` is the public way to write one of your own."""
    global _PROTOCOL_STREAM
    if _PROTOCOL_STREAM is None:
        fd = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        _PROTOCOL_STREAM = os.fdopen(fd, "w", encoding="utf-8", buffering=1)
    return _PROTOCOL_STREAM


def write_line(line, stream=None):
    """Writes one raw protocol line (a dict is encoded as JSON; a str is written as given,
    one newline added) and flushes: for workers that answer something `serve` would not
    (a test of how a campaign takes a misbehaving worker, a reply of your own). `stream`
    defaults to `protocol_stream()`."""
    out = stream if stream is not None else protocol_stream()
    text = line if isinstance(line, str) else json.dumps(line)
    out.write(text.rstrip("\n") + "\n")
    out.flush()


def handshake(adapter: Adapter) -> dict:
    prov = {str(k): str(v) for k, v in adapter.provenance.items()}
    prov["no_key_lse"] = str(adapter.no_key_lse)
    return {
        "protocol": PROTOCOL,
        "name": adapter.name,
        "version": adapter.version,
        "provenance": prov,
        "caps": adapter.caps.to_json(),
    }


@contextmanager
def _env(env: Optional[Dict[str, str]]):
    saved = {k: os.environ.get(k) for k in (env or {})}
    try:
        for k, v in (env or {}).items():
            os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _request_fields(req: dict, adapter: Adapter):
    for key in ("case", "out"):
        if not isinstance(req.get(key), str) or not req[key]:
            raise Invalid(f"request field {key} must be a non-empty path")
    want = req.get("want")
    if not isinstance(want, list) or not want or not all(w in WANT_NAMES for w in want):
        raise Invalid(
            f"request field want = {json.dumps(want)}: expected a non-empty list of {', '.join(WANT_NAMES)}")
    if len(set(want)) != len(want):
        raise Invalid(f"request field want = {json.dumps(want)} repeats a name")
    env = req.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise Invalid("request field env must map strings to strings")
    if not adapter.caps.harness_options:
        for key in ("force", "fill", "trace_env"):
            if req.get(key) is not None:
                raise Invalid(f"request field {key} is set but this worker does not declare harness_options")
    if req.get("lse_from") is not None:
        # the mixed-path check: a backward from another forward's O and LSE
        raise Unsupported("lse_from: this worker computes the backward from its own forward only")
    return want, env


def handle(req: dict, adapter: Adapter) -> dict:
    """Runs one `run` request; returns the reply (without catching: see `reply_for`).
    `elapsed_us` spans reading the case file to writing the outputs, as the protocol says."""
    t0 = time.perf_counter()
    want, env = _request_fields(req, adapter)
    case = read_case(req["case"])
    why = adapter.caps.outside(case)
    if why:
        raise Unsupported(why)
    if "lse" in want and not adapter.caps.lse:
        raise Unsupported("lse is outside the declared capabilities")
    if DBIAS in want and case.bias is None:
        raise Invalid(f"want names dbias, but {no_dbias_reason(case)}")
    grads = [w for w in want if w in ("dq", "dk", "dv", DBIAS)]
    if grads and not adapter.caps.backward:
        raise Unsupported("backward is outside the declared capabilities")
    if DBIAS in want and not adapter.caps.dbias:
        raise Unsupported("dbias is outside the declared capabilities")
    if grads and case.d_o is None:
        raise Invalid(f"want names {', '.join(grads)} but the case has no d_o")
    with _env(env):
        produced = adapter.run(case, frozenset(want))
    outs, mapped = finish_outputs(case, produced, want, adapter)
    if mapped:
        log(f"id {req.get('id')}: mapped {mapped} LSE entries of no-key rows from {adapter.no_key_lse} to -inf")
    write_safetensors(req["out"], {n: encode_tensor(a, "f32") for n, a in outs.items()})
    elapsed = time.perf_counter() - t0
    return {"id": req["id"], "ok": True, "elapsed_us": int(round(elapsed * 1e6))}


def reply_for(line: str, adapter: Adapter) -> Tuple[Optional[dict], bool]:
    """The reply to one input line and whether to stop. Never raises."""
    line = line.strip()
    if not line:
        return None, False
    rid = None
    try:
        try:
            req = json.loads(line)
        except ValueError as e:
            raise Invalid(f"request is not JSON: {e}") from None
        if not isinstance(req, dict):
            raise Invalid("request is not a JSON object")
        rid = req.get("id")
        if isinstance(rid, bool) or not isinstance(rid, int):
            rid = None
            raise Invalid(f"request id = {json.dumps(req.get('id'))}: expected an integer")
        op = req.get("op")
        if op == "shutdown":
            return {"id": rid, "ok": True}, True
        if op != "run":
            raise Invalid(f"unknown op {json.dumps(op)}")
        return handle(req, adapter), False
    except WorkerError as e:
        err = {"kind": e.kind, "message": str(e)}
    except Exception as e:
        log(traceback.format_exc())
        err = {"kind": "internal", "message": f"{type(e).__name__}: {e}"[:800]}
    if err["kind"] != "unsupported":
        log(f"id {rid}: {err['kind']}: {err['message']}")
    return {"id": rid, "ok": False, "error": err}, False


def resolve_probe(adapter: Adapter):
    """Replaces `no_key_lse = "probe"` by the convention measured on the implementation (in a
    dtype and head dim its caps declare) and records that it was measured. An implementation
    that follows no single convention cannot be served: the worker exits before its
    handshake, saying why."""
    caps = adapter.caps
    dtype = next((d for d in ("bf16", "f16", "f32") if d in caps.dtypes), None)
    dims = caps.head_dims or [64]
    dim = 64 if 64 in dims else dims[0]
    if dtype is None or "causal_bottom_right" not in caps.masks or not caps.lse:
        raise SystemExit(f"{adapter.name}: --no-key-lse probe needs lse and causal_bottom_right in its caps")
    try:
        adapter.no_key_lse, seen = probe_no_key_lse(adapter.run, dtype, dim)
    except WorkerError as e:
        raise SystemExit(f"{adapter.name}: --no-key-lse probe failed ({e.kind}): {e}") from None
    adapter.provenance["no_key_lse_source"] = f"probe ({dtype}, head dim {dim})"
    adapter.provenance["no_key_lse_probed"] = ", ".join(f"{float(v):.6g}" for v in seen[:4])
    log(f"no-key LSE convention measured: {adapter.no_key_lse}")


def start(adapter: Adapter):
    """What runs once before the first case: the adapter's `setup`, then a `probe`d no-key
    LSE convention measured. Whatever drives `adapter.run` outside `serve` calls this first."""
    if adapter.setup is not None:
        adapter.setup(adapter)
    if adapter.no_key_lse == PROBE:
        resolve_probe(adapter)


def serve(adapter: Adapter, stdin=None, stdout=None) -> int:
    """Handshake, then one reply per request line until `shutdown` or end of input."""
    out = stdout if stdout is not None else protocol_stream()
    inp = stdin if stdin is not None else sys.stdin
    start(adapter)
    write_line(handshake(adapter), out)
    for line in inp:
        reply, stop = reply_for(line, adapter)
        if reply is not None:
            try:
                write_line(reply, out)
            except BrokenPipeError:
                return 0
        if stop:
            break
    return 0
