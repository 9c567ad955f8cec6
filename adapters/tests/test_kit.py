"""The kit's conversions: float formats, case files, layouts, segment ids, LSE layouts."""

import math
import os
import tempfile
import unittest

import numpy as np

from casegen import kit, make_case, with_bias


class FloatFormats(unittest.TestCase):
    def test_bf16_bits_round_trip_every_pattern(self):
        bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
        f = kit.bf16_bits_to_f32(bits)
        back = kit.f32_to_bf16_bits(f)
        nan = np.isnan(f)
        np.testing.assert_array_equal(back[~nan], bits[~nan])
        self.assertTrue(np.isnan(kit.bf16_bits_to_f32(back[nan])).all())
        # quiet NaNs keep their payload bit for bit
        quiet = nan & ((bits & 0x40) != 0)
        np.testing.assert_array_equal(back[quiet], bits[quiet])

    def test_round_to_bf16_once_not_twice(self):
        # 1 + 2^-8 + 2^-30 is just above the tie between 1 and 1 + 2^-7: once -> 1 + 2^-7;
        # through f32 first it becomes the exact tie 1 + 2^-8 and then 1 (ties to even).
        x = 1 + 2.0**-8 + 2.0**-30
        self.assertEqual(kit.round_to_dtype([x], "bf16")[0], 1 + 2.0**-7)
        self.assertEqual(kit.round_to_dtype([1 + 2.0**-8], "bf16")[0], 1.0)
        self.assertEqual(kit.round_to_dtype([1 + 3 * 2.0**-8], "bf16")[0], 1 + 2.0**-6)
        big = float.fromhex("0x1.fep127")
        # half an ulp (2^119) above the largest finite value is a tie: to even, i.e. overflow
        self.assertEqual(kit.round_to_dtype([big + 2.0**119], "bf16")[0], math.inf)
        self.assertEqual(kit.round_to_dtype([big + 2.0**119 - 2.0**100], "bf16")[0], big)
        tiny = 2.0**-133  # the smallest bf16 subnormal
        np.testing.assert_array_equal(
            kit.round_to_dtype([tiny * 0.5, tiny * 0.51, tiny * 1.5, -tiny * 2.5], "bf16"),
            [0.0, tiny, 2 * tiny, -2 * tiny],
        )
        neg0 = kit.round_to_dtype([-0.0], "bf16")[0]
        self.assertTrue(neg0 == 0 and math.copysign(1, neg0) < 0)

    def test_round_matches_numpy_for_f16_and_f32(self):
        rng = np.random.default_rng(3)
        x = rng.standard_normal(20000) * np.exp2(rng.integers(-30, 20, 20000))
        x = np.concatenate([x, [np.nan, np.inf, -np.inf, 65519.99, 65520.0, 6e-8, 2.0**-25]])
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(kit.round_to_dtype(x, "f16"), x.astype(np.float16).astype(np.float64))
        y = x * 1e20
        np.testing.assert_array_equal(kit.round_to_dtype(y, "f32"), y.astype(np.float32).astype(np.float64))
        # encode_tensor casts instead of calling round_to_dtype: the same bytes
        with np.errstate(over="ignore"):
            for arr, dt, np_dt in ((x, "f16", "<f2"), (y, "f32", "<f4")):
                want = kit.round_to_dtype(arr, dt).astype(np_dt).tobytes()
                self.assertEqual(kit.encode_tensor(arr, dt)[2], want, dt)

    def test_bf16_rounding_agrees_with_bit_rounding_from_f32(self):
        rng = np.random.default_rng(4)
        x = (rng.standard_normal(20000) * np.exp2(rng.integers(-140, 120, 20000))).astype(np.float32)
        via_bits = kit.bf16_bits_to_f32(kit.f32_to_bf16_bits(x)).astype(np.float64)
        np.testing.assert_array_equal(kit.round_to_dtype(x, "bf16"), via_bits)


class CaseFiles(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "c.safetensors")

    def tearDown(self):
        self.dir.cleanup()

    def test_round_trip_each_dtype_with_padded_offsets(self):
        for dtype in kit.DTYPES:
            case = make_case([3, 0, 2], [2, 4, 1], dtype=dtype, gaps_q=[1, 0, 2], gaps_kv=[0, 3, 0], tail_q=2, tail_kv=1)
            kit.write_case(self.path, case)
            back = kit.read_case(self.path)
            self.assertEqual(back.config, case.config)
            for name in ("q", "k", "v", "d_o"):
                a, b = getattr(case, name), getattr(back, name)
                self.assertEqual(a.shape, b.shape)
                np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=f"{dtype} {name}")
            for s, t in ((case.sq, back.sq), (case.skv, back.skv)):
                np.testing.assert_array_equal(s.cu, t.cu)
                np.testing.assert_array_equal(s.offsets, t.offsets)
                self.assertEqual((s.tokens, s.padded), (t.tokens, t.padded))

    def test_library_reads_what_the_kit_writes(self):
        from safetensors.numpy import load_file

        case = make_case([2], [3], dtype="f16", backward=False)
        kit.write_case(self.path, case, {"o": np.ones((2, 2, 8))})
        loaded = load_file(self.path)
        self.assertEqual(sorted(loaded), ["cu_seqlens_kv", "cu_seqlens_q", "k", "o", "q", "v"])
        self.assertEqual(loaded["q"].dtype, np.float16)
        self.assertEqual(loaded["o"].dtype, np.float32)
        self.assertEqual(os.listdir(self.dir.name), ["c.safetensors"])

    def test_malformed_cases_are_invalid_naming_the_field(self):
        case = make_case([2], [2])
        bad = [
            ("cu_seqlens_q", ("I32", [2], np.array([0, 3], "<i4").tobytes()), "past the buffer"),
            ("cu_seqlens_kv", ("I32", [2], np.array([1, 2], "<i4").tobytes()), "cu_seqlens_kv[0] = 1"),
            ("cu_seqlens_kv", ("I32", [3], np.array([0, 2, 1], "<i4").tobytes()), "cu_seqlens_kv[2] = 1 is below"),
            ("cu_seqlens_kv", ("I32", [3], np.array([0, 1, 2], "<i4").tobytes()), "entries"),
            ("q", ("F16", [2, 2, 8], np.zeros(32, "<f2").tobytes()), "dtype F16, expected F32"),
            ("colour", ("F32", [1], np.zeros(1, "<f4").tobytes()), "unknown tensor colour"),
            ("k", ("F32", [2, 2, 4], np.zeros(16, "<f4").tobytes()), "expected [T, 2, 8]"),
        ]
        for name, tensor, needle in bad:
            kit.write_case(self.path, case)
            tensors, meta = kit.read_safetensors(self.path)
            raw = {n: kit.encode_tensor(a, "i32" if st == "I32" else "f32") for n, (st, a) in tensors.items()}
            raw[name] = tensor
            kit.write_safetensors(self.path, raw, meta)
            with self.assertRaises(kit.Invalid) as cm:
                kit.read_case(self.path)
            self.assertIn(needle, str(cm.exception), name)

    def test_config_rules(self):
        good = '{"dtype":"bf16","num_heads":4,"num_gqa_groups":2,"head_dim_qk":64,"head_dim_v":32,"mask":"padding"}'
        cfg = kit.parse_config(good)
        self.assertEqual((cfg.window, cfg.scale, cfg.layout, cfg.group), ((-1, -1), 0.125, "thd", 2))
        # The dropout keys smallseq writes (semantics.md §2.2): p = 1 allowed, 64-bit seeds.
        drop = kit.parse_config(good.replace("}", ',"dropout":1.0,"dropout_seed":18446744073709551615,"dropout_offset":5}'))
        self.assertEqual((drop.dropout, drop.dropout_seed, drop.dropout_offset), (1.0, 2**64 - 1, 5))
        self.assertEqual(kit.parse_config(drop.to_json()), drop)
        for text, needle in [
            (good.replace("}", ',"colour":1}'), "unknown key colour"),
            (good.replace('"num_gqa_groups":2', '"num_gqa_groups":3'), "does not divide"),
            (good.replace("}", ',"window":[1]}'), "window"),
            (good.replace("}", ',"dropout":1.5}'), "dropout = 1.5"),
            (good.replace("}", ',"dropout_seed":-1}'), "dropout_seed = -1"),
            (good.replace('"padding"', '"diagonal"'), "mask = diagonal"),
            ("[1]", "JSON object"),
        ]:
            with self.assertRaises(kit.Invalid) as cm:
                kit.parse_config(text)
            self.assertIn(needle, str(cm.exception))

    def test_undefined_bias_and_dropout_are_unsupported(self):
        case = make_case([2], [2])
        for field in ({"bias": "pre_scale_bias"}, {"dropout": 0.1}):
            c = case.config.__class__(**{**case.config.__dict__, **field})
            kit.write_case(self.path, kit.Case(c, case.q, case.k, case.v, case.d_o, case.sq, case.skv, {}))
            with self.assertRaises(kit.Unsupported):
                kit.read_case(self.path)

    def test_bias_tensors_are_read_and_checked(self):
        """semantics.md §1.9: the bias the config names is read; its shape, a tensor the config
        does not name and +inf at a visible key are `invalid`; the caps decide the rest."""
        case = make_case([2, 3], [3, 1], heads=2)
        cfg = case.config.__class__(**{**case.config.__dict__, "bias": "post_scale_bias", "bias_shape": "b1ss"})
        t = np.zeros((2, 1, 3, 3), np.float32)
        t[1, 0, 2, 2] = np.inf  # slot 1 has one key: column 2 is never read
        t[0, 0, 1, 0] = -np.inf
        biased = kit.Case(cfg, case.q, case.k, case.v, case.d_o, case.sq, case.skv, {}, bias=t)
        kit.write_case(self.path, biased)
        back = kit.read_case(self.path)
        self.assertEqual(back.config, cfg)
        np.testing.assert_array_equal(back.bias, t)
        self.assertIn("bias post_scale_bias", kit.Caps(dtypes=["f32"], masks=["padding"]).outside(back))
        self.assertIsNone(kit.Caps(dtypes=["f32"], masks=["padding"], bias=True, backward=True,
                                   max_tokens=None).outside(back))
        self.assertEqual(back.bias_of(0)[1, 1, 0], -np.inf)
        for bad_t, needle in [
            (np.zeros((1, 1, 3, 3), np.float32), "expected [2, 1, >= 3, >= 3]"),
            (np.where(np.arange(3) == 0, np.inf, 0).astype(np.float32)[None, None, None].repeat(2, 0).repeat(3, 2),
             "tensor bias[0, 0, 0, 0] = inf"),
        ]:
            kit.write_case(self.path, kit.Case(cfg, case.q, case.k, case.v, case.d_o, case.sq, case.skv, {},
                                               bias=bad_t))
            with self.assertRaises(kit.Invalid) as cm:
                kit.read_case(self.path)
            self.assertIn(needle, str(cm.exception))
        plain = kit.Case(case.config, case.q, case.k, case.v, case.d_o, case.sq, case.skv, {}, bias=t)
        kit.write_case(self.path, plain)
        with self.assertRaises(kit.Invalid) as cm:
            kit.read_case(self.path)
        self.assertIn("present, but smallseq.config has bias = none", str(cm.exception))
        alibi = case.config.__class__(**{**case.config.__dict__, "bias": "alibi"})
        kit.write_case(self.path, kit.Case(alibi, case.q, case.k, case.v, case.d_o, case.sq, case.skv, {},
                                           alibi_slopes=np.array([0.5, 0.25], np.float32)))
        got = kit.read_case(self.path).bias_of(0)  # slot 0: Lq 2, Lk 3
        np.testing.assert_array_equal(got[0], -0.5 * np.array([[1, 0, 1], [2, 1, 0]]))
        with self.assertRaises(kit.Invalid):
            kit.parse_config(cfg.to_json().replace('"b1ss"', '"b2ss"'))
        self.assertEqual(kit.parse_config(cfg.to_json()), cfg)


class Layouts(unittest.TestCase):
    def case(self):
        return make_case([3, 0, 2, 1], [2, 4, 0, 3], gaps_q=[1, 2, 0, 0], gaps_kv=[0, 1, 2, 0], tail_q=3, tail_kv=2)

    def test_pack_unpack_round_trip(self):
        case = self.case()
        p = kit.pack(case.q, case.sq)
        self.assertEqual(p.shape[0], 6)
        self.assertFalse(np.isnan(p).any())
        back = kit.unpack(p, case.sq)
        valid = case.sq.valid()
        np.testing.assert_array_equal(back[valid], case.q[valid])
        self.assertTrue((back[~valid] == 0).all())
        np.testing.assert_array_equal(kit.packed_cu(case.sq), [0, 3, 3, 5, 6])

    def test_padded_round_trip_and_span_carry(self):
        case = self.case()
        x = kit.to_padded(case.q, case.sq)
        self.assertEqual(x.shape, (4, 3, 2, 8))
        np.testing.assert_array_equal(kit.from_padded(x, case.sq)[case.sq.valid()], case.q[case.sq.valid()])
        self.assertTrue((x[0, 3:] == 0).all() and (x[1] == 0).all())
        carried = kit.to_padded(case.q, case.sq, s=4, pad="span")
        # slot 0 (length 3, span 4) carries its gap token; slot 1 (length 0, span 2) its two
        self.assertTrue(np.isnan(carried[0, 3]).all() and np.isnan(carried[1, :2]).all())
        self.assertTrue((carried[1, 2:] == 0).all() and (carried[3, 1:] == 0).all())
        np.testing.assert_array_equal(kit.from_padded(carried, case.sq)[case.sq.valid()], case.q[case.sq.valid()])

    def test_segment_ids_and_positions(self):
        case = self.case()
        ids, pos = kit.segment_ids(case.sq), kit.segment_pos(case.sq)
        np.testing.assert_array_equal(ids, [1, 1, 1, 0, 0, 0, 3, 3, 4, 0, 0, 0])
        np.testing.assert_array_equal(pos, [0, 1, 2, 0, 0, 0, 0, 1, 0, 0, 0, 0])

    def test_segment_ids_round_trip_without_empty_slots(self):
        for gaps, tail in (([0, 0, 0], 0), ([2, 0, 1], 3)):
            side = make_case([3, 1, 2], [3, 1, 2], gaps_q=gaps, tail_q=tail).sq
            back = kit.side_from_segments(kit.segment_ids(side))
            np.testing.assert_array_equal(back.cu, side.cu)
            np.testing.assert_array_equal(back.starts, side.starts)
            np.testing.assert_array_equal(back.valid(), side.valid())
            self.assertEqual(back.tokens, side.tokens)
        with self.assertRaises(kit.Invalid):
            kit.side_from_segments(np.array([1, 1, 3, 3]))

    def test_te_seqlens_offsets(self):
        case = self.case()
        seqlens, offsets = kit.te_seqlens_offsets(case.sq, max_segments=6)
        np.testing.assert_array_equal(seqlens, [[3, 0, 2, 1, -1, -1]])
        np.testing.assert_array_equal(offsets, [[0, 4, 6, 8, 9, -1, -1]])
        self.assertEqual((seqlens.dtype, offsets.dtype), (np.int32, np.int32))

    def test_make_side_rejects_bad_offsets(self):
        for cu, off, tokens, needle in [
            ([0, 2, 1], None, 4, "is below"),
            ([0, 2, 4], [0, 1, 4], 4, "exceeds its span"),
            ([0, 2], [1, 3], 2, "past the buffer"),
        ]:
            with self.assertRaises(kit.Invalid) as cm:
                kit.make_side(cu, off, tokens)
            self.assertIn(needle, str(cm.exception))


class Lse(unittest.TestCase):
    def test_every_layout_to_th(self):
        case = make_case([2, 0, 3], [2, 1, 3], heads=3, gaps_q=[1, 0, 0], tail_q=2)
        side = case.sq
        rng = np.random.default_rng(1)
        want = np.full((side.tokens, 3), -np.inf, dtype=np.float32)
        want[side.valid()] = rng.standard_normal((5, 3)).astype(np.float32)
        packed = want[side.token_index()]
        padded = kit.to_padded(want[:, :, None], side, s=32)[..., 0]  # [B, S, H], S rounded up
        cases = [
            (want, "th", False),
            (want.T, "ht", False),
            (packed, "th", True),
            (packed.T.copy(), "ht", True),
            (padded, "bsh", False),
            (padded.transpose(0, 2, 1), "bhs", False),
            (padded.transpose(0, 2, 1)[..., None], "bhs", False),
            (want[:, :, None], "th", False),
        ]
        for lse, layout, is_packed in cases:
            got = kit.lse_to_thd(lse, side, layout, packed=is_packed)
            self.assertEqual(got.dtype, np.float32)
            np.testing.assert_array_equal(got, want, err_msg=f"{layout} packed={is_packed} {lse.shape}")
        got2 = kit.lse_to_thd(want / math.log(2.0), side, "th", base="2")
        np.testing.assert_allclose(got2[side.valid()], want[side.valid()], rtol=1e-6)

    def test_no_key_convention_maps_only_the_declared_value_in_no_key_rows(self):
        lse = np.array([[np.inf, 1.0], [np.inf, np.nan], [-np.inf, np.inf]], dtype=np.float32)
        no_key = np.array([True, False, True])
        got, n = kit.map_no_key_lse(lse, no_key, "+inf")
        self.assertEqual(n, 2)
        np.testing.assert_array_equal(got, [[-np.inf, 1.0], [np.inf, np.nan], [-np.inf, -np.inf]])
        got, n = kit.map_no_key_lse(lse, no_key, "nan")
        self.assertEqual(n, 0)
        np.testing.assert_array_equal(got, lse)
        self.assertEqual(kit.map_no_key_lse(lse, no_key, "-inf")[1], 0)

    def test_the_zero_convention_maps_exact_zeros_in_no_key_rows_only(self):
        # PyTorch's memory-efficient kernel writes LSE 0 in a row without keys; a 0 elsewhere,
        # or a tiny nonzero value in such a row, is the implementation's own and stays.
        lse = np.array([[0.0, 1e-30], [0.0, 2.0], [-0.0, 0.5]], dtype=np.float32)
        got, n = kit.map_no_key_lse(lse, np.array([True, False, True]), "0")
        self.assertEqual(n, 2)
        np.testing.assert_array_equal(got, np.float32([[-np.inf, 1e-30], [0.0, 2.0], [-np.inf, 0.5]]))

    def test_underflow_maps_only_values_whose_exp_is_zero_in_no_key_rows(self):
        lse = np.float32([[-65535.0, -700.0], [-9e4, 1.5], [-746.0, -745.0]])
        got, n = kit.map_no_key_lse(lse, np.array([True, False, True]), "underflow")
        self.assertEqual(n, 3)
        np.testing.assert_array_equal(got, np.float32([[-np.inf, -700.0], [-9e4, 1.5], [-np.inf, -np.inf]]))

    def test_classify_no_key_lse(self):
        self.assertEqual(kit.classify_no_key_lse([np.inf, np.inf]), "+inf")
        self.assertEqual(kit.classify_no_key_lse([-np.inf]), "-inf")
        self.assertEqual(kit.classify_no_key_lse([np.nan, np.nan]), "nan")
        self.assertEqual(kit.classify_no_key_lse([0.0, -0.0]), "0")
        # cuDNN's, measured on the H200 (2026-12-03): finite, and 0 once exponentiated
        self.assertEqual(kit.classify_no_key_lse([-65535.07, -65534.83]), "underflow")
        self.assertEqual(kit.classify_no_key_lse([-3.4e38, -745.0]), "underflow")
        for bad in ([np.inf, 0.0], [-744.0], [-65535.0, -np.inf], [], [0.69314718]):
            with self.assertRaises(kit.Internal, msg=str(bad)):
                kit.classify_no_key_lse(bad)

    def test_the_probe_case_has_rows_without_keys_and_rows_with_keys(self):
        case = kit.no_key_probe_case("bf16", 64)
        np.testing.assert_array_equal(case.no_key_rows(), [True, True, False, False])
        self.assertEqual(case.q.shape, (4, 1, 64))
        # values exact in bf16: the case file of a probe would carry them unchanged
        np.testing.assert_array_equal(kit.round_to_dtype(case.q, "bf16"), case.q)

    def test_no_key_rows_and_padded_mask(self):
        case = make_case([3, 2], [1, 0], mask="causal_bottom_right", gaps_q=[1, 0])
        # slot 0: diag = r - 2, rows 0 and 1 see nothing; slot 1: no keys at all
        np.testing.assert_array_equal(case.no_key_rows(), [True, True, False, False, True, True])
        m = case.padded_mask()
        self.assertEqual(m.shape, (2, 3, 1))
        np.testing.assert_array_equal(m[0, :, 0], [False, False, True])
        self.assertFalse(m[1].any())


class Visibility(unittest.TestCase):
    def cfg(self, mask, window=(-1, -1)):
        return kit.Config("f32", 1, 1, 4, 4, mask, window, 0.5)

    def test_masks_and_windows(self):
        tl = kit.visibility(self.cfg("causal"), 2, 3)
        np.testing.assert_array_equal(tl, [[1, 0, 0], [1, 1, 0]])
        br = kit.visibility(self.cfg("padding_causal_bottom_right"), 2, 3)
        np.testing.assert_array_equal(br, [[1, 1, 0], [1, 1, 1]])
        win = kit.visibility(self.cfg("no_mask", (1, 0)), 3, 3)
        np.testing.assert_array_equal(win, [[1, 0, 0], [1, 1, 0], [0, 1, 1]])
        # windows are bottom-right aligned even under a top-left causal mask
        both = kit.visibility(self.cfg("causal", (1, -1)), 2, 3)
        np.testing.assert_array_equal(both, [[1, 0, 0], [0, 1, 0]])
        self.assertFalse(kit.visibility(self.cfg("causal", (0, -1)), 2, 3).any())


class DBiasOutputs(unittest.TestCase):
    """dBias (semantics.md §1.9): shaped as the case's bias tensor, and only where it has one."""

    def adapter(self, **caps):
        return kit.Adapter("t", "1", kit.Caps(**caps), lambda case, want: {})

    def test_finish_outputs_checks_the_dbias_shape_against_the_bias_tensor(self):
        # Sq, Sk larger than the longest lengths (3, 4): dBias has the tensor's shape.
        case = with_bias(make_case([2, 3], [4, 1], heads=2), "b1ss", sq=5, sk=6)
        self.assertEqual(case.bias.shape, (2, 1, 5, 6))
        a = self.adapter(dbias=True, backward=True)
        good = {"dbias": np.zeros((2, 1, 5, 6), np.float32)}
        out, _ = kit.finish_outputs(case, good, ["dbias"], a)
        self.assertEqual(out["dbias"].shape, (2, 1, 5, 6))
        for wrong in [(2, 1, 3, 4), (1, 1, 5, 6), (2, 2, 5, 6), (2, 5, 6)]:
            with self.assertRaises(kit.Internal) as cm:
                kit.finish_outputs(case, {"dbias": np.zeros(wrong)}, ["dbias"], a)
            self.assertIn(f"output dbias: shape {list(wrong)}, expected [2, 1, 5, 6]", str(cm.exception))
        with self.assertRaises(kit.Internal) as cm:
            kit.finish_outputs(case, {}, ["dbias"], a)
        self.assertIn("did not produce dbias", str(cm.exception))

    def test_dbias_of_a_case_without_a_post_scale_bias_is_invalid(self):
        plain = make_case([2], [2])
        for case, needle in ((plain, "no post_scale_bias (bias = none)"),
                             (with_bias(plain, "alibi"), "alibi, whose slopes take no gradient")):
            self.assertNotIn("dbias", kit.output_shapes(case))
            with self.assertRaises(kit.Invalid) as cm:
                kit.finish_outputs(case, {"dbias": np.zeros((1, 2, 2, 2))}, ["dbias"], self.adapter(dbias=True))
            self.assertIn("want names dbias, but the case", str(cm.exception))
            self.assertIn(needle, str(cm.exception))

    def test_no_query_outputs_hold_a_zero_dbias_with_a_post_scale_bias(self):
        case = with_bias(make_case([0, 0], [2, 1]), "bhss", sq=1, sk=2)
        np.testing.assert_array_equal(kit.no_query_outputs(case)["dbias"], np.zeros((2, 2, 1, 2)))
        self.assertNotIn("dbias", kit.no_query_outputs(make_case([0], [2])))

    def test_caps_declare_dbias_off_by_default(self):
        self.assertFalse(kit.Caps().to_json()["dbias"])
        self.assertTrue(kit.Caps(dbias=True).to_json()["dbias"])


class DeclaredDesign(unittest.TestCase):
    def test_the_design_travels_only_when_declared(self):
        self.assertNotIn("design", kit.Caps().to_json())
        self.assertEqual(kit.Caps(design="project").to_json()["design"], "project")


if __name__ == "__main__":
    unittest.main()
