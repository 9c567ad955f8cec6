"""A stand-in for TransformerEngine's JAX attention API, for testing adapters/te_jax.py where
TE cannot be installed. It follows TE's documented contract (signatures of
`transformer_engine.jax.attention.fused_attn` and `cpp_extensions.attention.fused_attn_fwd`,
`SequenceDescriptor`, mask and layout enums; O and grads zero at padded tokens; token-major
softmax_aux `[B, S, H, 1]` for THD, `[B, H, S, 1]` for BSHD) and computes with plain JAX.
It tests the adapter's plumbing, never TE."""

__version__ = "fake-for-tests"
