"""Framework adapters against numpy_reference, where the framework is installed (CI has
neither torch nor jax: these skip there; they run on a developer machine or the H200)."""

import importlib.util
import os
import unittest

import numpy as np

from casegen import kit, make_case  # first: puts adapters/ on sys.path

import numpy_reference as ref  # noqa: E402

ALL = frozenset(kit.OUTPUTS)


def geometries():
    """(name, case) pairs over the classes every adapter claims: GQA, masks, windows, empty
    slots, tails, long slots."""
    yield "mha-padding", make_case([3, 5], [4, 5], heads=2, dqk=16, mask="padding", seed=1, poison=0.0)
    yield "gqa-causal-square", make_case([4, 2], [4, 2], heads=4, kv_heads=2, dqk=16, mask="padding_causal", seed=2, poison=0.0)
    yield "causal-tl-rect", make_case([3, 2], [5, 4], heads=2, dqk=16, mask="causal", seed=3, poison=0.0)
    yield "causal-br-rect", make_case([3, 2], [5, 4], heads=2, dqk=16, mask="causal_bottom_right", seed=4, poison=0.0)
    yield "window-square", make_case([6, 5], [6, 5], heads=2, dqk=16, mask="no_mask", window=(2, 1), seed=5, poison=0.0)
    yield "window-rect", make_case([4, 3], [6, 5], heads=2, dqk=16, mask="padding", window=(1, 0), seed=6, poison=0.0)
    yield "gaps-tail", make_case([2, 3], [3, 1], gaps_q=[1, 0], gaps_kv=[2, 0], tail_q=2, tail_kv=1, dqk=16, seed=7, poison=0.0)
    yield "long", make_case([40], [33], heads=1, dqk=32, mask="padding_causal_bottom_right", seed=8, poison=0.0)


class FrameworkCase(unittest.TestCase):
    def compare(self, adapter, tol):
        if adapter.setup:
            adapter.setup(adapter)
        checked = 0
        for name, case in geometries():
            with self.subTest(geometry=name):
                if adapter.caps.outside(case):
                    continue
                want = ALL if adapter.caps.lse else ALL - {"lse"}
                try:
                    got = adapter.run(case, want)
                except kit.Unsupported:
                    continue
                got, _ = kit.finish_outputs(case, got, want, adapter)
                exp = ref.attention(case, want)
                no_key = case.no_key_rows()
                for out in sorted(want):
                    rows = ~no_key if out in ("o", "lse", "dq") and adapter.caps.no_key_row == "other" else slice(None)
                    a, b = np.asarray(got[out], np.float64)[rows], np.asarray(exp[out], np.float64)[rows]
                    np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=f"{name} {out}")
                checked += 1
        self.assertGreater(checked, 0)


@unittest.skipUnless(importlib.util.find_spec("jax"), "jax is not installed")
class JaxXla(FrameworkCase):
    def test_f32_against_reference(self):
        import jax_attention

        self.compare(jax_attention.adapter(["--implementation", "xla", "--lse"]), 2e-5)


@unittest.skipUnless(importlib.util.find_spec("jax"), "jax is not installed")
class TeJaxOnAStandIn(FrameworkCase):
    """te_jax's plumbing (descriptor, layouts, jit, vjp, aux) through tests/fake_te, a JAX
    stand-in that keeps TE's documented contract: it tests the adapter, not TE."""

    def test_f32_plumbing_against_reference(self):
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_te"))
        try:
            import te_jax

            a = te_jax.adapter([])
            a.caps.dtypes.append("f32")  # the stand-in computes f32; TE itself is declared bf16/f16
            a.caps.head_dims = None
            self.compare(a, 2e-5)
        finally:
            sys.path.pop(0)
            for name in [n for n in sys.modules if n.startswith("transformer_engine")]:
                del sys.modules[name]


@unittest.skipUnless(importlib.util.find_spec("torch"), "torch is not installed")
class TorchMath(FrameworkCase):
    def test_f32_against_reference(self):
        import torch_sdpa

        self.compare(torch_sdpa.adapter(["--kernel", "math"]), 2e-5)


if __name__ == "__main__":
    unittest.main()
