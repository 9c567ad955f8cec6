"""numpy_reference against cases computed by hand (semantics.md §1)."""

import math
import unittest

import numpy as np

from casegen import kit, make_case, with_bias  # first: puts adapters/ on sys.path

import numpy_reference as ref  # noqa: E402

ALL = frozenset(kit.OUTPUTS)


def case_of(q, k, v, d_o, lens_q, lens_kv, mask="no_mask", window=(-1, -1), scale=1.0, dtype="f32", offs_q=None):
    q, k, v, d_o = (np.asarray(x, dtype=np.float32) for x in (q, k, v, d_o))
    cfg = kit.Config(dtype, q.shape[1], k.shape[1], q.shape[2], v.shape[2], mask, window, scale)
    cu = lambda lens: np.concatenate([[0], np.cumsum(lens)])  # noqa: E731
    sq = kit.make_side(cu(lens_q), offs_q, q.shape[0])
    skv = kit.make_side(cu(lens_kv), None, k.shape[0])
    return kit.Case(cfg, q, k, v, d_o, sq, skv, {})


class HandComputed(unittest.TestCase):
    def test_one_row_two_keys(self):
        # scores 0 and ln 3 -> P = [1/4, 3/4]; O = 4/4 + 3*8/4 = 7; LSE = ln 4
        # d_o = 1: dP = [4, 8], D = 7, dS = [-3/4, 3/4]; dq = 3/4 ln 3; dk = dS q; dv = P
        c = case_of([[[1.0]]], [[[0.0]], [[math.log(3)]]], [[[4.0]], [[8.0]]], [[[1.0]]], [1], [2])
        out = ref.attention(c, ALL)
        self.assertAlmostEqual(out["o"][0, 0, 0], 7.0, places=5)
        self.assertAlmostEqual(out["lse"][0, 0], math.log(4), places=6)
        self.assertAlmostEqual(out["dq"][0, 0, 0], 0.75 * math.log(3), places=6)
        np.testing.assert_allclose(out["dk"][:, 0, 0], [-0.75, 0.75], rtol=1e-6)
        np.testing.assert_allclose(out["dv"][:, 0, 0], [0.25, 0.75], rtol=1e-6)

    def test_dbias_of_one_row_two_keys_is_ds(self):
        # as above with a zero post-scale bias [1, 1, 2, 3] (Sq, Sk past the lengths 1, 2):
        # dBias = dS = [-3/4, 3/4] where the row reads, 0 elsewhere
        c = case_of([[[1.0]]], [[[0.0]], [[math.log(3)]]], [[[4.0]], [[8.0]]], [[[1.0]]], [1], [2])
        c = with_bias(c, "1hss", sq=2, sk=3)
        c.bias[:] = 0.0
        out = ref.attention(c, ALL | {"dbias"})
        self.assertAlmostEqual(out["o"][0, 0, 0], 7.0, places=5)
        np.testing.assert_allclose(out["dbias"][0, 0], [[-0.75, 0.75, 0.0], [0.0, 0.0, 0.0]], rtol=1e-6)

    def test_dbias_matches_finite_differences_for_every_broadcast(self):
        """dBias = d(sum o * d_o)/d(bias), summed over the slots and heads sharing an entry:
        checked entry by entry against central differences, with GQA, a causal mask, -inf
        entries (their keys hidden: dBias 0) and entries past the lengths (never read: 0)."""
        for i, shape in enumerate(["1hss", "11ss", "b1ss", "bhss"]):
            base = make_case([3, 2], [2, 4], heads=4, kv_heads=2, dqk=4, dv=3, mask="padding_causal_bottom_right",
                             seed=11 + i)
            c = with_bias(base, shape, sq=4, sk=5, seed=i)
            c.bias = c.bias.astype(np.float64)
            c.bias[..., 1, 0] = -np.inf
            grad = ref.attention64(c, frozenset({"dbias"}))["dbias"]
            self.assertEqual(grad.shape, c.bias.shape)
            d_o = np.nan_to_num(c.d_o.astype(np.float64))

            def loss():
                return float((ref.attention64(c, frozenset({"o"}))["o"] * d_o).sum())

            eps = 2.0 ** -12
            for idx in np.ndindex(*c.bias.shape):
                x = c.bias[idx]
                if x == -np.inf:
                    self.assertEqual(grad[idx], 0.0, msg=f"{shape} {idx}")
                    continue
                c.bias[idx] = x + eps
                up = loss()
                c.bias[idx] = x - eps
                down = loss()
                c.bias[idx] = x
                fd = (up - down) / (2 * eps)
                self.assertAlmostEqual(fd, grad[idx], delta=1e-5, msg=f"{shape} dbias{list(idx)}")
            # row 3 and column 4: no slot has 4 queries or 5 keys
            self.assertTrue((grad[:, :, 3, :] == 0).all() and (grad[:, :, :, 4] == 0).all(), shape)
            self.assertTrue(np.abs(grad).max() > 0.01, shape)

    def test_no_visible_key_row_is_zero_with_minus_inf_lse(self):
        # bottom-right causal, Lq = 2, Lk = 1: row 0 sees nothing, row 1 sees key 0
        c = case_of([[[1.0]], [[2.0]]], [[[0.5]]], [[[3.0]]], [[[1.0]], [[1.0]]], [2], [1], mask="causal_bottom_right")
        out = ref.attention(c, ALL)
        self.assertEqual(out["o"][0, 0, 0], 0.0)
        self.assertEqual(out["lse"][0, 0], -np.inf)
        self.assertEqual(out["dq"][0, 0, 0], 0.0)
        self.assertEqual(out["o"][1, 0, 0], 3.0)
        self.assertEqual(out["lse"][1, 0], 1.0)  # the only score: 2 * 0.5
        self.assertEqual(out["dv"][0, 0, 0], 1.0)  # only row 1 contributes, P = 1
        self.assertEqual(out["dk"][0, 0, 0], 0.0)  # a single key: dS = P (dP - D) = 0
        self.assertFalse(any(np.isnan(a).any() for a in out.values()))

    def test_top_left_causal_with_more_keys(self):
        # Lq = 2, Lk = 3, top-left: row 0 sees key 0 only, row 1 keys 0 and 1
        q = [[[0.0]], [[0.0]]]
        c = case_of(q, [[[0.0]]] * 3, [[[1.0]], [[3.0]], [[100.0]]], q, [2], [3], mask="causal")
        out = ref.attention(c, ALL)
        np.testing.assert_allclose(out["o"][:, 0, 0], [1.0, 2.0])
        np.testing.assert_allclose(out["lse"][:, 0], [0.0, math.log(2)], rtol=1e-6)

    def test_window_zero_zero_sees_the_diagonal_only(self):
        v = [[[1.0]], [[2.0]], [[3.0]]]
        c = case_of([[[1.0]]] * 3, [[[1.0]], [[2.0]], [[3.0]]], v, v, [3], [3], window=(0, 0))
        out = ref.attention(c, ALL)
        np.testing.assert_array_equal(out["o"][:, 0, 0], [1.0, 2.0, 3.0])
        np.testing.assert_array_equal(out["lse"][:, 0], [1.0, 2.0, 3.0])

    def test_gqa_sums_the_group_into_dk_dv(self):
        # two query heads share one kv head; each head alone: one key, P = 1, dv = d_o
        q = [[[1.0], [2.0]]]
        d_o = [[[1.0], [10.0]]]
        c = case_of(q, [[[1.0]]], [[[5.0]]], d_o, [1], [1])
        out = ref.attention(c, ALL)
        np.testing.assert_array_equal(out["o"][0, :, 0], [5.0, 5.0])
        self.assertEqual(out["dv"][0, 0, 0], 11.0)
        self.assertEqual(out["dk"].shape, (1, 1, 1))

    def test_dont_care_tokens_are_ignored_and_zero(self):
        clean = make_case([2, 1], [3, 2], gaps_q=[2, 0], tail_q=1, tail_kv=2, poison=0.0, seed=7)
        dirty = make_case([2, 1], [3, 2], gaps_q=[2, 0], tail_q=1, tail_kv=2, poison=np.nan, seed=7)
        a, b = ref.attention(clean, ALL), ref.attention(dirty, ALL)
        for name in ALL:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        dc_q, dc_kv = ~dirty.sq.valid(), ~dirty.skv.valid()
        self.assertTrue((b["o"][dc_q] == 0).all() and (b["dq"][dc_q] == 0).all())
        self.assertTrue(np.isneginf(b["lse"][dc_q]).all())
        self.assertTrue((b["dk"][dc_kv] == 0).all() and (b["dv"][dc_kv] == 0).all())

    def test_outputs_are_rounded_once_to_the_input_dtype(self):
        c = make_case([3], [4], dtype="bf16", heads=4, kv_heads=2, dqk=16, dv=8, mask="padding_causal", seed=2)
        out = ref.attention(c, ALL)
        for name in ("o", "dq", "dk", "dv"):
            np.testing.assert_array_equal(out[name], kit.round_to_dtype(out[name], "bf16"), err_msg=name)
        np.testing.assert_array_equal(out["lse"], kit.round_to_dtype(out["lse"], "f32"))

    def test_backward_matches_finite_differences(self):
        c = make_case([3, 2], [2, 4], heads=2, kv_heads=1, dqk=4, dv=3, mask="padding_causal_bottom_right",
                      window=(2, 0), seed=5)
        cfg64 = kit.Config("f32", *[getattr(c.config, f) for f in ("num_heads", "num_kv_heads", "head_dim_qk",
                                                                      "head_dim_v", "mask", "window", "scale")])
        c.config = cfg64
        grads = ref.attention(c, ALL)

        def loss(case):
            # the rounding to f32 is far below the step used here
            return float((ref.attention(case, frozenset({"o"}))["o"] * np.nan_to_num(case.d_o)).sum())

        eps = 1e-2
        for name, grad in (("q", "dq"), ("k", "dk"), ("v", "dv")):
            x = getattr(c, name)
            side = c.sq if name == "q" else c.skv
            t = int(side.token_index()[1])
            for h in range(x.shape[1]):
                orig = x[t, h, 0]
                x[t, h, 0] = orig + eps
                up = loss(c)
                x[t, h, 0] = orig - eps
                down = loss(c)
                x[t, h, 0] = orig
                self.assertAlmostEqual((up - down) / (2 * eps), grads[grad][t, h, 0], delta=2e-3, msg=f"{grad}[{t},{h}]")


if __name__ == "__main__":
    unittest.main()
