"""numpy_reference and the kit's case reader against the Rust f64 reference, on the case files
the Rust side wrote (tests/capsules): after rounding the Rust outputs once to the case dtype
(LSE to f32), every output must be bitwise equal, except where the two f64 computations may
legitimately round to neighbouring values: both sum the same terms in different orders, so they
may differ by up to a few f64 units of the sum of the terms' magnitudes, and where the terms
cancel almost exactly that can straddle a rounding boundary of the case dtype. Such an element
is accepted only when the two f64 results lie within that bound of each other. Runs when
SMALLSEQ_BIN names the smallseq binary (ci/adapters.sh sets it)."""

import glob
import os
import subprocess
import tempfile
import unittest

import numpy as np

from casegen import kit  # first: puts adapters/ on sys.path

import numpy_reference as ref  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("SMALLSEQ_BIN")
F64_UNIT = 2.0 ** -53


def magnitudes(case) -> dict:
    """For O, dQ, dK and dV: the sum of the magnitudes of the terms each element is computed
    from (every product and difference taken in absolute value), and the number of roundings
    on the longest path to it. An f64 evaluation in any order is within about
    `roundings * F64_UNIT * magnitude` of the exact value."""
    c = case.config
    g, hkv = c.group, c.num_kv_heads
    q, k, v = (np.abs(x.astype(np.float64)) for x in (case.q, case.k, case.v))
    d_o = np.abs(case.d_o.astype(np.float64)) if case.d_o is not None else None
    mag = {n: np.zeros_like(a) for n, a in kit.no_query_outputs(case).items() if n != "lse"}
    lmax = 1
    for i in range(case.sq.slots):
        lq, lk = int(case.sq.lens[i]), int(case.skv.lens[i])
        if lq == 0 or lk == 0:
            continue
        lmax = max(lmax, lq, lk)
        oq, ok = int(case.sq.starts[i]), int(case.skv.starts[i])
        qs, ks = q[oq : oq + lq], np.repeat(k[ok : ok + lk], g, axis=1)
        vs = np.repeat(v[ok : ok + lk], g, axis=1)
        p = ref.softmax64(case, i)[0]  # [H, Lq, Lk]; P <= 1, so its own error is relative
        mag["o"][oq : oq + lq] = np.einsum("hrc,chd->rhd", p, vs)
        if d_o is None:
            continue
        dos = d_o[oq : oq + lq]
        dp = np.einsum("rhd,chd->hrc", dos, vs)
        ds = p * (dp + (p * dp).sum(axis=2, keepdims=True))
        mag["dq"][oq : oq + lq] = c.scale * np.einsum("hrc,chd->rhd", ds, ks)
        dke = c.scale * np.einsum("hrc,rhd->chd", ds, qs)
        dve = np.einsum("hrc,rhd->chd", p, dos)
        mag["dk"][ok : ok + lk] = dke.reshape(lk, hkv, g, -1).sum(axis=2)
        mag["dv"][ok : ok + lk] = dve.reshape(lk, hkv, g, -1).sum(axis=2)
    roundings = 2 * (c.head_dim_qk + c.head_dim_v + 2 * lmax + g) + 32
    return {n: (m, roundings) for n, m in mag.items()}


@unittest.skipUnless(BIN, "SMALLSEQ_BIN is not set")
class AgainstRustReference(unittest.TestCase):
    def test_stored_capsules_bitwise_after_one_rounding(self):
        files = sorted(glob.glob(os.path.join(ROOT, "tests", "capsules", "**", "*.safetensors"), recursive=True))
        self.assertGreater(len(files), 0)
        with tempfile.TemporaryDirectory() as d:
            for i, f in enumerate(files):
                with self.subTest(capsule=os.path.relpath(f, ROOT)):
                    out = os.path.join(d, f"{i}.safetensors")
                    subprocess.run([BIN, "run", "--backend", "reference", "--case", f, "--out", out],
                                   check=True, capture_output=True, timeout=120)
                    rust, _ = kit.read_safetensors(out)
                    case = kit.read_case(f)
                    want = frozenset(n for n in kit.OUTPUTS if n in rust)
                    self.assertIn("o", want)
                    got64 = ref.attention64(case, want)
                    mags = magnitudes(case)
                    for name in want:
                        dt = "f32" if name == "lse" else case.config.dtype
                        got, exp = kit.round_to_dtype(got64[name], dt), kit.round_to_dtype(rust[name][1], dt)
                        differ = ~((got == exp) | (np.isnan(got) & np.isnan(exp)))
                        if name in mags and differ.any():
                            mag, roundings = mags[name]
                            bound = 2 * roundings * F64_UNIT * mag
                            near = np.abs(got64[name] - rust[name][1]) <= bound
                            differ &= ~near
                        bad = np.argwhere(differ)
                        self.assertEqual(len(bad), 0, f"{name}: {len(bad)} elements differ beyond "
                                         f"reordering, first at {bad[:1].tolist()}: numpy "
                                         f"{got[tuple(bad[0])] if len(bad) else 0} vs Rust "
                                         f"{exp[tuple(bad[0])] if len(bad) else 0}")

    def test_bias_cases_in_f64(self):
        """semantics.md §1.9 on both sides: post-scale biases of every broadcast (with -inf
        entries, and +inf where nothing reads) and ALiBi, the Rust f64 reference's outputs
        against numpy's f64 ones (both f64: they agree to reordering, 1e-9 relative), dBias
        of the post-scale ones included."""
        from casegen import make_case

        rng = np.random.default_rng(3)
        with tempfile.TemporaryDirectory() as d:
            for i, shape in enumerate(["1hss", "11ss", "b1ss", "bhss", "alibi", "alibi"]):
                case = make_case([3, 0, 5], [4, 2, 5], heads=4, kv_heads=2, seed=i,
                                 mask=["padding", "padding_causal_bottom_right"][i % 2])
                c = case.config
                if shape == "alibi":
                    cfg = c.__class__(**{**c.__dict__, "bias": "alibi"})
                    extra = {"alibi_slopes": (rng.random(4) * 0.3).astype(np.float32)}
                else:
                    cfg = c.__class__(**{**c.__dict__, "bias": "post_scale_bias", "bias_shape": shape})
                    bb, hb = (3 if shape[0] == "b" else 1), (4 if shape[1] == "h" else 1)
                    t = rng.standard_normal((bb, hb, 6, 5)).astype(np.float32)
                    t[rng.random(t.shape) < 0.2] = -np.inf
                    t[:, :, 5, :] = np.inf  # row 5: no slot has 6 queries
                    extra = {"bias": t}
                biased = kit.Case(cfg, case.q, case.k, case.v, case.d_o, case.sq, case.skv, {}, **extra)
                f, out = os.path.join(d, f"{i}.safetensors"), os.path.join(d, f"{i}.out.safetensors")
                kit.write_case(f, biased)
                subprocess.run([BIN, "run", "--backend", "reference", "--case", f, "--out", out],
                               check=True, capture_output=True, timeout=120)
                rust, _ = kit.read_safetensors(out)
                read = kit.read_case(f)
                names = kit.WANT_NAMES if read.bias is not None else kit.OUTPUTS
                got = ref.attention64(read, frozenset(names))
                for name in names:
                    with self.subTest(shape=shape, tensor=name):
                        exp = rust[name][1]
                        self.assertFalse(np.isnan(got[name]).any())
                        np.testing.assert_allclose(got[name], exp, rtol=1e-9, atol=1e-12)
                self.assertEqual("dbias" in rust, shape != "alibi")


if __name__ == "__main__":
    unittest.main()
