"""The framework adapters' own conversions and declarations, without the frameworks."""

import importlib.util
import json
import unittest

import numpy as np

from casegen import kit, make_case, with_bias  # first: puts adapters/ on sys.path

import jax_attention  # noqa: E402
import numpy_reference  # noqa: E402
import te_jax  # noqa: E402
import torch_sdpa  # noqa: E402
import torch_varlen  # noqa: E402


class Declarations(unittest.TestCase):
    def test_every_adapter_builds_a_handshake_without_its_framework(self):
        adapters = [
            numpy_reference.adapter(),
            torch_varlen.adapter([]),
            torch_varlen.adapter(["--kernel", "cudnn", "--tail", "pass"]),
            jax_attention.adapter(["--implementation", "xla"]),
            jax_attention.adapter(["--implementation", "cudnn", "--lse"]),
            te_jax.adapter([]),
        ] + [torch_sdpa.adapter(["--kernel", k]) for k in ("math", "efficient", "flash", "cudnn")]
        names = set()
        for a in adapters:
            hs = json.loads(json.dumps(kit.handshake(a)))
            caps = hs["caps"]
            self.assertEqual(hs["protocol"], "smallseq-worker/1")
            self.assertTrue(set(caps["dtypes"]) <= set(kit.DTYPES), a.name)
            self.assertTrue(set(caps["masks"]) <= set(kit.MASKS), a.name)
            self.assertIn(caps["no_key_row"], ("zero", "nan", "other"), a.name)
            self.assertIn(hs["provenance"]["no_key_lse"], kit.NO_KEY_LSE + (kit.PROBE,), a.name)
            self.assertFalse(caps["reports_path"] or caps["reports_workspace"] or caps["harness_options"])
            names.add(hs["name"])
        self.assertEqual(len(names), len(adapters))

    def test_no_key_lse_is_declared_per_kernel(self):
        # FINDINGS.md item 3: efficient and cudnn wrote something other than -inf there.
        declared = {k: torch_sdpa.adapter(["--kernel", k]).no_key_lse for k in ("math", "efficient", "flash", "cudnn")}
        self.assertEqual(declared, {"math": "-inf", "flash": "+inf", "efficient": kit.PROBE, "cudnn": kit.PROBE})
        self.assertEqual(torch_sdpa.adapter(["--kernel", "cudnn", "--no-key-lse", "0"]).no_key_lse, "0")
        self.assertEqual(torch_varlen.adapter([]).no_key_lse, "+inf")
        self.assertEqual(torch_varlen.adapter(["--kernel", "cudnn"]).no_key_lse, kit.PROBE)

    def test_nondeterministic_dq_is_declared_where_documented(self):
        # PyTorch's memory-efficient and FA2 backwards sum dQ over key blocks in run order
        # (torch_sdpa.py's and torch_varlen.py's headers); nothing else declares anything.
        hs = kit.handshake(torch_sdpa.adapter(["--kernel", "efficient"]))
        self.assertEqual(hs["caps"]["nondeterministic"], ["dq"])
        self.assertIn("atomic", hs["caps"]["nondeterministic_note"])
        self.assertEqual(kit.handshake(torch_varlen.adapter([]))["caps"]["nondeterministic"], ["dq"])
        flash = kit.handshake(torch_sdpa.adapter(["--kernel", "flash"]))["caps"]
        self.assertEqual(flash["nondeterministic"], ["dq"])
        quiet = [torch_sdpa.adapter(["--kernel", k]) for k in ("math", "cudnn")] + [
            torch_varlen.adapter(["--kernel", "cudnn"]), numpy_reference.adapter(),
            jax_attention.adapter(["--implementation", "xla"]), jax_attention.adapter(["--implementation", "cudnn"]),
            te_jax.adapter([])]
        for a in quiet:
            self.assertNotIn("nondeterministic", kit.handshake(a)["caps"], a.name)

    def test_declared_limits(self):
        sdpa = {k: torch_sdpa.caps_for(k) for k in ("math", "efficient", "flash", "cudnn")}
        self.assertFalse(sdpa["math"].lse)
        self.assertFalse(sdpa["efficient"].gqa)
        self.assertFalse(sdpa["flash"].window)
        self.assertEqual([sdpa[k].bias for k in ("math", "efficient", "flash", "cudnn")], [True, True, False, True])
        self.assertEqual([sdpa[k].dbias for k in ("math", "efficient", "flash", "cudnn")], [True, True, False, False])
        self.assertTrue(numpy_reference.adapter().caps.dbias)
        others = [torch_varlen.adapter([]), jax_attention.adapter(["--implementation", "xla"]), te_jax.adapter([])]
        self.assertFalse(any(a.caps.dbias for a in others))
        self.assertNotIn("f32", sdpa["cudnn"].dtypes)
        self.assertFalse(torch_varlen.adapter([]).caps.padded_offsets)
        self.assertEqual(jax_attention.adapter(["--implementation", "xla"]).caps.no_key_row, "other")
        self.assertFalse(jax_attention.adapter(["--implementation", "xla"]).caps.lse)


def sdpa_math(bc, mask):
    """SDPA's math in f64 numpy on `bc`'s padded batch with the additive `mask [B, H, Sq, Sk]`:
    `({"o", "lse"} padded, P with 0 in fully masked rows, V padded)`."""
    sq, sk = mask.shape[2:]
    q = kit.to_padded(bc.q, bc.sq, sq).astype(np.float64)
    k = kit.to_padded(bc.k, bc.skv, sk).astype(np.float64)
    v = kit.to_padded(bc.v, bc.skv, sk).astype(np.float64)
    s = bc.config.scale * np.einsum("bqhd,bkhd->bhqk", q, k) + mask
    m = s.max(axis=3, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.log(e.sum(axis=3)) + m[..., 0]
        p = e / e.sum(axis=3, keepdims=True)
    res = {"o": np.nan_to_num(np.einsum("bhqk,bkhd->bqhd", p, v), nan=0.0), "lse": lse}
    return res, np.nan_to_num(p), v


class TorchSdpa(unittest.TestCase):
    def test_pad_rows_see_key_zero_and_only_the_case_rows_are_fully_masked(self):
        case = make_case([3, 1, 0], [1, 2, 2], mask="causal_bottom_right")
        m = torch_sdpa.pad_row_mask(case, 3, 2)
        self.assertEqual(m.shape, (3, 1, 3, 2))
        fully = ~m[:, 0].any(axis=2)
        # slot 0 rows 0, 1 see no key (diag = r - 2); every pad row sees key 0
        np.testing.assert_array_equal(fully, [[True, True, False], [False, False, False], [False, False, False]])
        np.testing.assert_array_equal(m[1, 0, 0], [True, True])  # Lq = 1, Lk = 2: diag = 1

    def test_the_bias_mask_is_the_bias_where_visible_and_hidden_rows_read_as_no_key(self):
        """SDPA's math on the padded batch with `bias_mask`, in numpy, then `hide_rows`: the
        forward of semantics.md §1.9 as numpy_reference computes it (rows the bias hides
        entirely included), for a post-scale bias and ALiBi."""
        case = make_case([3, 1, 2], [2, 4, 3], heads=2, mask="padding_causal_bottom_right", seed=4)
        c = case.config
        t = np.random.default_rng(1).standard_normal((3, 2, 4, 4)).astype(np.float32)
        t[0, 1, 2, :] = -np.inf  # slot 0, head 1, row 2: every key hidden
        t[:, :, 3, :] = np.nan  # row 3: no slot has four queries
        biased = [
            kit.Case(c.__class__(**{**c.__dict__, "bias": "post_scale_bias", "bias_shape": "bhss"}),
                     case.q, case.k, case.v, case.d_o, case.sq, case.skv, {}, bias=t),
            kit.Case(c.__class__(**{**c.__dict__, "bias": "alibi"}), case.q, case.k, case.v, case.d_o,
                     case.sq, case.skv, {}, alibi_slopes=np.array([0.25, 0.75], np.float32)),
        ]
        for bc in biased:
            sq, sk = bc.sq.max_len, bc.skv.max_len
            mask, hidden = torch_sdpa.bias_mask(bc, sq, sk)
            self.assertEqual(mask.shape, (3, 2, sq, sk))
            self.assertFalse(np.isnan(mask).any())
            res, p, v = sdpa_math(bc, mask)
            torch_sdpa.hide_rows(res, hidden)
            got = kit.from_padded_outputs(bc, res)
            want = numpy_reference.attention64(bc, frozenset(["o", "lse"]))
            # The mask is f32 (ALiBi's products rounded, the outputs unpadded as f32).
            np.testing.assert_allclose(got["o"], want["o"], rtol=1e-6, atol=1e-7)
            live = np.isfinite(want["lse"])
            np.testing.assert_array_equal(live, np.isfinite(got["lse"]))
            np.testing.assert_allclose(got["lse"][live], want["lse"][live], rtol=1e-6)
            if bc.bias is not None:
                self.assertTrue(hidden[0, 1, 2] and hidden.sum() == 1)
                self.assertEqual(want["lse"][2, 1], -np.inf)
                self.check_dbias_of_the_leaf(bc, p, v, hidden)

    def test_a_fused_kernel_refuses_a_mask_its_dtype_cannot_hold(self):
        """ALiBi at large distances does not hold in f16 (the fused kernels take the mask in
        the query's dtype, where it would be another bias): unsupported, naming the entry. A
        post-scale bias (stored in the input dtype) and f32 always hold."""
        case = make_case([20, 2], [3, 2], heads=2, dtype="f16", mask="padding", seed=6)
        c = case.config
        slopes = np.array([0.2079, 0.5], np.float32)
        alibi = kit.Case(c.__class__(**{**c.__dict__, "bias": "alibi"}), case.q, case.k, case.v, case.d_o,
                         case.sq, case.skv, {}, alibi_slopes=slopes)
        mask, _ = torch_sdpa.bias_mask(alibi, 20, 3)
        with self.assertRaises(kit.Unsupported) as e:
            torch_sdpa.inexact_mask(mask, "f16", "efficient")
        self.assertIn("is not exact in f16", str(e.exception))
        torch_sdpa.inexact_mask(mask, "f32", "efficient")
        post, _ = torch_sdpa.bias_mask(with_bias(case, "bhss", seed=2), 20, 3)
        torch_sdpa.inexact_mask(post, "f16", "efficient")

    @unittest.skipUnless(importlib.util.find_spec("torch"), "torch is not installed")
    def test_a_launch_without_keys_has_a_zero_dbias(self):
        """A batch whose slots hold no key (half of a split, CPU campaign seed 41, case 781):
        SDPA's graph never reads the bias, and dBias is 0 where torch gives no gradient."""
        case = with_bias(make_case([0, 3], [0, 0], heads=1, dtype="f16", seed=3), "bhss", sq=4, sk=2)
        ad = torch_sdpa.adapter(["--kernel", "math"])
        kit.start(ad)
        out, _ = kit.finish_outputs(case, ad.run(case, frozenset(["o", "dq", "dk", "dv", kit.DBIAS])),
                                    frozenset(["o", "dq", "dk", "dv", kit.DBIAS]), ad)
        self.assertEqual(out[kit.DBIAS].shape, case.bias.shape)
        self.assertFalse(np.asarray(out[kit.DBIAS]).any())

    def test_the_bias_leaf_takes_dbias_for_every_broadcast(self):
        """As above for the broadcasts that sum over slots or heads, with Sq and Sk past the
        longest lengths and a row the bias hides."""
        case = make_case([3, 1, 2], [2, 4, 3], heads=2, mask="padding", seed=5)
        for i, shape in enumerate(["1hss", "11ss", "b1ss"]):
            bc = with_bias(case, shape, sq=5, sk=6, seed=i)
            bc.bias[0, :, 1, :] = -np.inf  # row 1 of slot 0 (and of every slot sharing the plane)
            mask, hidden = torch_sdpa.bias_mask(bc, 3, 4)
            self.assertTrue(hidden[0, :, 1].all())
            _, p, v = sdpa_math(bc, mask)
            self.check_dbias_of_the_leaf(bc, p, v, hidden)

    def check_dbias_of_the_leaf(self, bc, p, v, hidden):
        """The gradient `bias_leaf_mask`'s graph gives the bias leaf, in numpy: dS of the padded
        batch (d_o 0 in pad and hidden rows, as `run` sets it), passed by the two `torch.where`s
        where a key is visible and not a key-0 fix, summed over the expanded slots and heads,
        placed in the leaf's shape: numpy_reference's dBias."""
        sq, sk = bc.sq.max_len, bc.skv.max_len
        vis, key0, _ = torch_sdpa.mask_parts(bc, sq, sk)
        d_o = kit.to_padded(bc.d_o, bc.sq, sq, "zero").astype(np.float64)
        b, h, r = np.nonzero(hidden)
        d_o[b, r, h] = 0.0
        dp = np.einsum("bqhd,bkhd->bhqk", d_o, v)
        ds = p * (dp - (p * dp).sum(axis=3, keepdims=True))
        g = np.where(vis & ~key0, ds, 0.0)
        leaf = np.zeros(bc.bias.shape)
        bb, hb = bc.bias.shape[:2]
        leaf[:, :, :sq, :sk] = g.sum(axis=tuple(a for a, n in ((0, bb), (1, hb)) if n == 1), keepdims=True)
        want = numpy_reference.attention64(bc, frozenset(["dbias"]))["dbias"]
        np.testing.assert_allclose(leaf, want, rtol=1e-9, atol=1e-12)
        self.assertTrue(np.abs(want).max() > 0.01)

    def test_length_groups(self):
        case = make_case([2, 0, 2, 3], [4, 1, 4, 3])
        self.assertEqual(torch_sdpa.length_groups(case), {(2, 4): [0, 2], (3, 3): [3]})

    def test_cases_without_queries_need_no_launch(self):
        case = make_case([0, 0], [3, 1])
        z = kit.no_query_outputs(case)
        self.assertTrue(np.isneginf(z["lse"]).all() and not z["dk"].any())


class TorchVarlen(unittest.TestCase):
    def test_a_launch_without_queries_is_answered_without_torch(self):
        # A batch split's launch whose slots hold no query (H100 seed 67, group 85: varlen_attn
        # refused its empty q); run() must not reach torch, which this object does not have.
        adapter = torch_varlen.TorchVarlen.__new__(torch_varlen.TorchVarlen)
        case = make_case([0], [15])
        got = adapter.run(case, frozenset(["o", "lse", "dq", "dk", "dv"]))
        self.assertTrue(np.isneginf(got["lse"]).all() and not got["o"].any() and not got["dv"].any())

    def test_windows_and_causal_become_fa2_window_sizes(self):
        for mask, window, lens_q, lens_kv, want in [
            ("padding", (-1, -1), [2, 3], [4, 3], (-1, -1)),
            ("padding", (3, 1), [2, 3], [4, 3], (3, 1)),
            ("causal_bottom_right", (-1, -1), [2, 3], [4, 3], (-1, 0)),
            ("padding_causal_bottom_right", (2, 5), [2], [4], (2, 0)),
            ("causal", (-1, -1), [3, 0, 2], [3, 4, 2], (-1, 0)),
        ]:
            case = make_case(lens_q, lens_kv, mask=mask, window=window)
            self.assertEqual(torch_varlen.window_size(case), want, (mask, window))
        with self.assertRaises(kit.Unsupported):
            torch_varlen.window_size(make_case([2], [3], mask="padding_causal"))

    def test_lse_layouts(self):
        self.assertEqual(torch_varlen.lse_layout((4, 10), 4, 10), "ht")
        self.assertEqual(torch_varlen.lse_layout((10, 4), 4, 10), "th")
        self.assertEqual(torch_varlen.lse_layout((3, 4, 8), 4, 10), "bhs")
        with self.assertRaises(kit.Internal):
            torch_varlen.lse_layout((5, 5), 4, 10)


    def test_tail_rows_are_zero_in_both_tail_modes(self):
        case = make_case([2, 3], [1, 2], heads=2, tail_q=2, tail_kv=1)
        rng = np.random.default_rng(0)
        for tail in ("pass", "trim"):
            nq, nk = (7, 4) if tail == "pass" else (5, 3)
            res = {
                "o": rng.standard_normal((nq, 2, 8)).astype(np.float32),
                "dk": rng.standard_normal((nk, 2, 8)).astype(np.float32),
                "lse": rng.standard_normal((2, nq)),  # [H, T], as CUDA varlen returns it
            }
            out = torch_varlen.TorchVarlen("flash", tail).back_to_thd(case, res, frozenset({"o", "dk", "lse"}))
            np.testing.assert_array_equal(out["o"][:5], res["o"][:5])
            self.assertFalse(out["o"][5:].any() or out["dk"][3:].any())
            np.testing.assert_array_equal(out["lse"][:5], res["lse"][:, :5].T.astype(np.float32))
            self.assertTrue(np.isneginf(out["lse"][5:]).all())


class JaxPlan(unittest.TestCase):
    def test_native_arguments_where_exact(self):
        p = jax_attention.plan(make_case([2, 3], [4, 3], mask="padding_causal"), "cudnn")
        self.assertEqual((p["is_causal"], p["local_window_size"], p["mask"]), (True, None, None))
        p = jax_attention.plan(make_case([3, 2], [3, 2], mask="causal_bottom_right", window=(1, -1)), "cudnn")
        self.assertEqual((p["is_causal"], p["local_window_size"]), (True, (1, 4)))
        p = jax_attention.plan(make_case([3, 2], [3, 2], window=(-1, 0)), "xla", 8, 16)
        self.assertEqual((p["is_causal"], p["local_window_size"]), (False, (17, 0)))
        self.assertEqual([jax_attention.bucket(n) for n in (0, 1, 8, 9, 17, 100)], [8, 8, 8, 16, 32, 128])

    def test_explicit_mask_on_xla_and_unsupported_on_cudnn(self):
        case = make_case([2, 3], [4, 3], mask="causal_bottom_right")
        p = jax_attention.plan(case, "xla")
        self.assertEqual(p["mask"].shape, (2, 1, 3, 4))
        self.assertEqual(jax_attention.plan(case, "xla", 8, 8)["mask"].shape, (2, 1, 8, 8))
        np.testing.assert_array_equal(p["mask"][0, 0, :2], [[1, 1, 1, 0], [1, 1, 1, 1]])
        with self.assertRaises(kit.Unsupported):
            jax_attention.plan(case, "cudnn")


class TeJax(unittest.TestCase):
    def test_descriptor_arrays_keep_offsets_and_empty_slots(self):
        case = make_case([2, 0, 3], [1, 2, 0], gaps_q=[1, 0, 2], tail_kv=3)
        sl_q, sl_kv, off_q, off_kv, m = te_jax.descriptor_arrays(case)
        self.assertEqual(m, 3)
        np.testing.assert_array_equal(sl_q, [[2, 0, 3]])
        np.testing.assert_array_equal(off_q, [[0, 3, 3, 8]])
        np.testing.assert_array_equal(sl_kv, [[1, 2, 0]])
        np.testing.assert_array_equal(off_kv, [[0, 1, 3, 3]])
        _, _, off_empty, _, m0 = te_jax.descriptor_arrays(make_case([], []))
        self.assertEqual(m0, 1)
        np.testing.assert_array_equal(off_empty, [[0, -1]])

    def test_windows_and_aux_layouts(self):
        self.assertIsNone(te_jax.window_for(make_case([2], [3])))
        self.assertEqual(te_jax.window_for(make_case([2], [3], mask="padding_causal_bottom_right", window=(1, 0))), (1, 0))
        with self.assertRaises(kit.Unsupported):
            te_jax.window_for(make_case([2], [3], mask="padding", window=(1, 0)))
        self.assertEqual(te_jax.aux_layout((1, 10, 4, 1), 4, 10), "th")
        self.assertEqual(te_jax.aux_layout((1, 4, 10, 1), 4, 10), "ht")
        with self.assertRaises(kit.Unsupported):
            te_jax.aux_layout((1, 4, 10, 3), 4, 10)

    def test_keywords_follow_the_signature(self):
        def old(qkv, bias, sequence_descriptor, seed, attn_mask_type, window_size=None):
            return None

        kw = te_jax.keywords(old, bias=None, softmax_type=1, window_size=(1, 0), attn_mask_type=2)
        self.assertEqual(kw, {"bias": None, "window_size": (1, 0), "attn_mask_type": 2})


if __name__ == "__main__":
    unittest.main()
