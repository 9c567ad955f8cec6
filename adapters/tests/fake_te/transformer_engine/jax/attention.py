"""Fake `transformer_engine.jax.attention` (see the package docstring)."""

from enum import Enum

import jax
import jax.numpy as jnp


class AttnBiasType(Enum):
    NO_BIAS = 0
    PRE_SCALE_BIAS = 1
    POST_SCALE_BIAS = 2


class AttnMaskType(Enum):
    NO_MASK = 0
    PADDING_MASK = 1
    CAUSAL_MASK = 2
    PADDING_CAUSAL_MASK = 3
    CAUSAL_BOTTOM_RIGHT_MASK = 4
    PADDING_CAUSAL_BOTTOM_RIGHT_MASK = 5

    def is_causal(self):
        return self.value >= 2

    def is_bottom_right(self):
        return self.value >= 4


class QKVLayout(Enum):
    BSHD_BSHD_BSHD = 9
    THD_THD_THD = 14

    def is_thd(self):
        return self is QKVLayout.THD_THD_THD


class SequenceDescriptor:
    def __init__(self, seqlens, seq_offsets=None):
        self.seqlens, self.seq_offsets = seqlens, seq_offsets

    @classmethod
    def from_seqlens(cls, seqlens):
        return cls(seqlens)

    @classmethod
    def from_seqlens_and_offsets(cls, seqlens, seq_offsets):
        return cls(seqlens, seq_offsets)


def _segments(lens, offs, s):
    """Per token of each row: slot index (-1 outside), position, and the slot's length."""
    t = jnp.arange(s)[None, :, None]
    inside = (t >= offs[:, None, :-1]) & (t < offs[:, None, :-1] + lens[:, None, :]) & (lens[:, None, :] > 0)
    slot = jnp.where(inside.any(-1), jnp.argmax(inside, -1), -1)
    start = jnp.take_along_axis(offs[:, :-1], jnp.maximum(slot, 0), 1)
    length = jnp.take_along_axis(lens, jnp.maximum(slot, 0), 1)
    return slot, t[..., 0] - start, length


def core(q, k, v, sd, mask_type, layout, scale, window):
    b, sq, h, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    lq, lk = sd.seqlens
    if sd.seq_offsets is None:
        zeros = jnp.zeros((b, 1), jnp.int32)
        lq, lk = lq.reshape(b, 1), lk.reshape(b, 1)
        oq, ok = jnp.concatenate([zeros, lq], 1), jnp.concatenate([zeros, lk], 1)
    else:
        oq, ok = sd.seq_offsets
        lq, lk = jnp.maximum(lq, 0), jnp.maximum(lk, 0)
    slot_q, pos_q, len_q = _segments(lq, oq, sq)
    slot_k, pos_k, len_k = _segments(lk, ok, sk)
    vq, vk = slot_q >= 0, slot_k >= 0
    q = jnp.where(vq[..., None, None], q, 0).astype(jnp.float32)
    k = jnp.where(vk[..., None, None], k, 0).astype(jnp.float32)
    v = jnp.where(vk[..., None, None], v, 0).astype(jnp.float32)
    g = h // hkv
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    vis = (slot_q[:, :, None] == slot_k[:, None, :]) & vq[:, :, None] & vk[:, None, :]
    pq, pk = pos_q[:, :, None], pos_k[:, None, :]
    diag = pq + (len_k[:, None, :] - len_q[:, :, None]) if mask_type.is_bottom_right() else pq
    if mask_type.is_causal():
        vis &= pk <= diag
    left, right = window if window is not None else (-1, -1)
    if left >= 0:
        vis &= pk >= diag - left
    if right >= 0:
        vis &= pk <= diag + right
    vis = vis[:, None]  # [B, 1, Sq, Sk]
    s = jnp.where(vis, scale * jnp.einsum("bqhd,bkhd->bhqk", q, k), 0.0)
    m = jnp.max(jnp.where(vis, s, -jnp.inf), -1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(s - m), 0.0)
    l = p.sum(-1, keepdims=True)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l > 0, l, 1.0), v).astype(q.dtype)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)[..., 0]  # [B, H, Sq]
    aux = lse.transpose(0, 2, 1)[..., None] if layout.is_thd() else lse[..., None]
    return out, jax.lax.stop_gradient(aux)


def fused_attn(qkv, bias, sequence_descriptor, seed, attn_bias_type, attn_mask_type, qkv_layout,
               scaling_factor, dropout_probability, is_training, max_segments_per_seq=1, window_size=None):
    q, k, v = qkv
    out, _ = core(q, k, v, sequence_descriptor, attn_mask_type, qkv_layout, scaling_factor, window_size)
    return out.astype(q.dtype)
