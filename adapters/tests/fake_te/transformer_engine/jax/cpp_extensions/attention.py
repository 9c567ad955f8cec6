"""Fake `transformer_engine.jax.cpp_extensions.attention` (see the package docstring)."""

from ..attention import core


def fused_attn_fwd(qkv, bias, sequence_descriptor, seed, attn_bias_type, attn_mask_type, qkv_layout,
                   scaling_factor, dropout_probability, is_training, max_segments_per_seq, window_size=None):
    q, k, v = qkv
    out, aux = core(q, k, v, sequence_descriptor, attn_mask_type, qkv_layout, scaling_factor, window_size)
    return out.astype(q.dtype), aux, None
