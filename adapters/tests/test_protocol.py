"""The protocol loop: handshake, replies, error kinds, output files, stdout discipline."""

import io
import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

from casegen import kit, make_case, with_bias

HERE = os.path.dirname(os.path.abspath(__file__))
ADAPTERS = os.path.dirname(HERE)


def echo_adapter(run=None, **caps):
    """An adapter whose outputs are simple functions of the inputs (O = V's first rows...)."""

    def default_run(case, want):
        c = case.config
        out = {
            "o": np.full((case.sq.tokens, c.num_heads, c.head_dim_v), 2.0),
            "lse": np.where(case.no_key_rows()[:, None], np.inf, 1.0) * np.ones((1, c.num_heads)),
            "dq": np.zeros_like(case.q),
            "dk": np.zeros_like(case.k),
            "dv": np.zeros_like(case.v),
        }
        return {k: v for k, v in out.items() if k in want}

    base = dict(dtypes=["f32", "bf16"], masks=list(kit.MASKS), backward=True, lse=True, padded_offsets=True)
    base.update(caps)
    return kit.Adapter("echo", "1", kit.Caps(**base), run or default_run, no_key_lse="+inf")


class Loop(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.d = self.dir.name

    def tearDown(self):
        self.dir.cleanup()

    def case_file(self, name="c", **kw):
        path = os.path.join(self.d, f"{name}.in.safetensors")
        kit.write_case(path, make_case(**{"lens_q": [2, 1], "lens_kv": [3, 2], **kw}))
        return path

    def converse(self, adapter, requests):
        out = io.StringIO()
        lines = [r if isinstance(r, str) else json.dumps(r) for r in requests]
        self.assertEqual(kit.serve(adapter, io.StringIO("\n".join(lines) + "\n"), out), 0)
        replies = [json.loads(x) for x in out.getvalue().splitlines()]
        return replies[0], replies[1:]

    def run_req(self, rid, case, want=("o", "lse"), **extra):
        out = os.path.join(self.d, f"{rid}.out.safetensors")
        return {"id": rid, "op": "run", "case": case, "out": out, "want": list(want), "env": {}, **extra}

    def test_handshake_fields(self):
        hs, replies = self.converse(echo_adapter(), [])
        self.assertEqual(hs["protocol"], "smallseq-worker/1")
        self.assertEqual(hs["name"], "echo")
        self.assertEqual(hs["provenance"]["no_key_lse"], "+inf")
        caps = hs["caps"]
        for key in ("dtypes", "layouts", "masks", "window", "gqa", "dv_ne_dqk", "head_dims", "max_tokens",
                    "backward", "lse", "padded_offsets", "reports_path", "reports_workspace",
                    "follows_small_seq_roundings", "harness_options", "no_key_row", "arch", "small_seq", "devices",
                    "dropout", "bias", "dbias"):
            self.assertIn(key, caps)
        self.assertEqual(replies, [])

    def test_the_handshake_carries_declared_nondeterministic_outputs(self):
        # Undeclared: the field is absent, as in every handshake written before it.
        hs, _ = self.converse(echo_adapter(), [])
        self.assertNotIn("nondeterministic", hs["caps"])
        self.assertNotIn("nondeterministic_note", hs["caps"])
        hs, _ = self.converse(
            echo_adapter(nondeterministic=("dq",), nondeterministic_note="dq summed with atomics"), [])
        self.assertEqual(hs["caps"]["nondeterministic"], ["dq"])
        self.assertEqual(hs["caps"]["nondeterministic_note"], "dq summed with atomics")
        # A name that is no output is the adapter's mistake, said before any handshake.
        with self.assertRaises(ValueError) as cm:
            kit.Caps(nondeterministic=("dx",)).to_json()
        self.assertIn("Caps.nondeterministic", str(cm.exception))

    def test_the_handshake_carries_a_declared_case_timeout(self):
        hs, _ = self.converse(echo_adapter(), [])
        self.assertNotIn("case_timeout_s", hs["caps"])
        hs, _ = self.converse(echo_adapter(case_timeout_s=180.0), [])
        self.assertEqual(hs["caps"]["case_timeout_s"], 180.0)
        for bad in (0, -1.0, 1e9):
            with self.assertRaises(ValueError) as cm:
                kit.Caps(case_timeout_s=bad).to_json()
            self.assertIn("Caps.case_timeout_s", str(cm.exception))

    def probing_adapter(self, no_key_value):
        """numpy_reference with `no_key_value` written into the LSE of rows without keys."""
        import numpy_reference

        ref = numpy_reference.adapter()

        def run(case, want):
            out = numpy_reference.attention(case, want | {"lse"})
            out["lse"] = np.where(case.no_key_rows()[:, None], no_key_value, out["lse"])
            return {k: v for k, v in out.items() if k in want}

        return kit.Adapter("probed", "1", ref.caps, run, no_key_lse=kit.PROBE)

    def test_a_probed_convention_is_measured_declared_and_mapped(self):
        for value, name in ((np.inf, "+inf"), (0.0, "0"), (np.nan, "nan"), (-np.inf, "-inf"), (-65535.0, "underflow")):
            case = self.case_file(mask="causal_bottom_right", lens_q=[3], lens_kv=[1])
            req = self.run_req(1, case)
            hs, (reply,) = self.converse(self.probing_adapter(value), [req])
            self.assertEqual(hs["provenance"]["no_key_lse"], name)
            self.assertIn("probe", hs["provenance"]["no_key_lse_source"])
            probed = float(hs["provenance"]["no_key_lse_probed"].split(", ")[0])
            self.assertTrue(probed == value or (np.isnan(probed) and np.isnan(value)), name)
            self.assertTrue(reply["ok"], reply)
            lse = kit.read_safetensors(req["out"])[0]["lse"][1]
            # rows 0, 1 see no key (mapped to -inf); row 2 sees the one key
            np.testing.assert_array_equal(lse[:2], -np.inf, err_msg=name)
            self.assertTrue(np.all(np.isfinite(lse[2])), name)

    def test_a_probe_that_finds_no_convention_stops_the_worker_before_its_handshake(self):
        out = io.StringIO()
        with self.assertRaises(SystemExit) as e:
            kit.serve(self.probing_adapter(-3.5), io.StringIO(""), out)
        self.assertIn("no single no-key LSE convention", str(e.exception))
        self.assertEqual(out.getvalue(), "")

    def test_run_writes_outputs_and_maps_the_declared_no_key_lse(self):
        case = self.case_file(mask="causal_bottom_right", lens_q=[3], lens_kv=[1])
        req = self.run_req(5, case, want=("o", "lse", "dq", "dk", "dv"))
        _, (reply, bye) = self.converse(echo_adapter(), [req, {"id": 6, "op": "shutdown"}])
        self.assertEqual((reply["id"], reply["ok"]), (5, True))
        self.assertEqual(bye, {"id": 6, "ok": True})
        self.assertIsInstance(reply["elapsed_us"], int)
        tensors, _ = kit.read_safetensors(req["out"])
        self.assertEqual(sorted(tensors), ["dk", "dq", "dv", "lse", "o"])
        self.assertTrue(all(st == "F32" for st, _ in tensors.values()))
        lse = tensors["lse"][1]
        # rows 0 and 1 see no key: the adapter's +inf there means -inf; row 2 keeps 1.0
        np.testing.assert_array_equal(lse[:, 0], [-np.inf, -np.inf, 1.0])
        self.assertEqual([f for f in os.listdir(self.d) if ".tmp." in f], [])

    def test_shutdown_replies_and_stops(self):
        case = self.case_file()
        _, replies = self.converse(echo_adapter(), [{"id": 1, "op": "shutdown"}, self.run_req(2, case)])
        self.assertEqual(replies, [{"id": 1, "ok": True}])

    def test_error_kinds(self):
        case = self.case_file()
        fwd_only = os.path.join(self.d, "f.in.safetensors")
        kit.write_case(fwd_only, make_case([2], [2], backward=False))
        f16 = self.case_file("h", dtype="f16")
        requests = [
            "this is not json",
            json.dumps([1, 2]),
            {"id": "seven", "op": "run"},
            {"id": 1, "op": "dance"},
            self.run_req(2, os.path.join(self.d, "missing.safetensors")),
            self.run_req(3, case, want=("o", "attn")),
            self.run_req(4, fwd_only, want=("o", "dq")),
            self.run_req(5, f16),
            self.run_req(6, case, fill="nan"),
            {"id": 7, "op": "run", "case": case, "want": ["o"]},
            self.run_req(8, case, lse_from=case),
        ]
        _, replies = self.converse(echo_adapter(), requests)
        got = [(r["id"], r["ok"], r["error"]["kind"]) for r in replies]
        self.assertEqual(
            got,
            [
                (None, False, "invalid"),
                (None, False, "invalid"),
                (None, False, "invalid"),
                (1, False, "invalid"),
                (2, False, "invalid"),
                (3, False, "invalid"),
                (4, False, "invalid"),
                (5, False, "unsupported"),
                (6, False, "invalid"),
                (7, False, "invalid"),
                (8, False, "unsupported"),
            ],
        )
        self.assertIn("dtype f16", replies[7]["error"]["message"])

    def test_dbias_is_written_when_wanted_and_refused_where_it_cannot_be(self):
        import numpy_reference

        ref = numpy_reference.adapter()
        grads = ("o", "lse", "dq", "dk", "dv", "dbias")
        base = make_case([2, 3], [3, 1], heads=2, seed=4)

        def write(name, case):
            path = os.path.join(self.d, f"{name}.in.safetensors")
            kit.write_case(path, case)
            return path

        biased = write("b", with_bias(base, "11ss", sq=4, sk=5))
        fwd_only = write("f", with_bias(make_case([2], [2], backward=False), "1hss"))
        requests = [
            self.run_req(1, biased, want=grads),
            self.run_req(2, write("n", base), want=grads),
            self.run_req(3, write("a", with_bias(base, "alibi")), want=grads),
            self.run_req(4, fwd_only, want=("o", "dbias")),
            self.run_req(5, biased, want=("o", "dbias", "dbias")),
        ]
        _, replies = self.converse(ref, requests)
        got = [(r["id"], r["ok"], r.get("error", {}).get("kind")) for r in replies]
        self.assertEqual(got, [(1, True, None), (2, False, "invalid"), (3, False, "invalid"),
                               (4, False, "invalid"), (5, False, "invalid")])
        self.assertIn("want names dbias, but the case has no post_scale_bias (bias = none)",
                      replies[1]["error"]["message"])
        self.assertIn("alibi, whose slopes take no gradient", replies[2]["error"]["message"])
        self.assertIn("no d_o", replies[3]["error"]["message"])
        tensors, _ = kit.read_safetensors(requests[0]["out"])
        self.assertEqual(sorted(tensors), sorted(grads))
        self.assertEqual(tensors["dbias"][0], "F32")  # as every output, whatever the case dtype
        self.assertEqual(tensors["dbias"][1].shape, (1, 1, 4, 5))
        # An adapter that does not declare dbias refuses it as outside its capabilities.
        _, (reply,) = self.converse(echo_adapter(bias=True), [self.run_req(6, biased, want=grads)])
        self.assertEqual(reply["error"]["kind"], "unsupported")
        self.assertIn("dbias is outside the declared capabilities", reply["error"]["message"])

    def test_library_errors_are_classified_and_adapter_bugs_are_internal(self):
        def refusing(case, want):
            with kit.calling("lib"):
                raise RuntimeError("No available kernel. Aborting execution.")

        def crashing(case, want):
            with kit.calling("lib"):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def buggy(case, want):
            return {"o": np.zeros(3)}

        case = self.case_file()
        for run, kind, needle in (
            (refusing, "unsupported", "lib: RuntimeError: No available kernel"),
            (crashing, "device", "illegal memory access"),
            (buggy, "internal", "output o: shape [3]"),
        ):
            _, (reply,) = self.converse(echo_adapter(run), [self.run_req(1, case, want=("o",))])
            self.assertEqual(reply["error"]["kind"], kind)
            self.assertIn(needle, reply["error"]["message"])
            self.assertFalse(os.path.exists(os.path.join(self.d, "1.out.safetensors")))

    def test_env_applies_to_one_request_only(self):
        seen = []

        def run(case, want):
            seen.append(os.environ.get("NVTE_FUSED_ATTN_CK_SMALLSEQ"))
            return {"o": np.zeros((case.sq.tokens, 2, 8))}

        case = self.case_file()
        r1 = self.run_req(1, case, want=("o",), env={"NVTE_FUSED_ATTN_CK_SMALLSEQ": "1"})
        r2 = self.run_req(2, case, want=("o",))
        self.converse(echo_adapter(run), [r1, r2])
        self.assertEqual(seen, ["1", None])


class Subprocess(unittest.TestCase):
    """The real entry point: stdout holds protocol lines only, whatever the adapter prints."""

    def test_numpy_reference_over_pipes(self):
        with tempfile.TemporaryDirectory() as d:
            case = os.path.join(d, "1.in.safetensors")
            kit.write_case(case, make_case([2, 3], [2, 4], dtype="bf16", gaps_q=[1, 0], tail_kv=2))
            req = {"id": 1, "op": "run", "case": case, "out": os.path.join(d, "1.out.safetensors"),
                   "want": ["o", "lse", "dq", "dk", "dv"], "env": {}}
            script = (
                "import sys; sys.path.insert(0, sys.argv[1]); import numpy_reference as r, smallseq_adapter as kit\n"
                "a = r.adapter()\n"
                "def setup(a): print('stray print from a library'); sys.stdout.flush()\n"
                "a.setup = setup\n"
                "sys.exit(kit.serve(a))\n"
            )
            proc = subprocess.run(
                [sys.executable, "-c", script, ADAPTERS],
                input=json.dumps(req) + "\nnot json\n",
                capture_output=True,
                text=True,
                timeout=60,
            )
            self.assertEqual(proc.returncode, 0, proc.stderr)
            lines = proc.stdout.splitlines()
            self.assertEqual(len(lines), 3, proc.stdout)
            hs, ok, bad = (json.loads(x) for x in lines)
            self.assertEqual(hs["name"], "numpy-reference")
            self.assertTrue(ok["ok"], ok)
            self.assertEqual(bad["error"]["kind"], "invalid")
            self.assertIn("stray print", proc.stderr)
            tensors, _ = kit.read_safetensors(req["out"])
            self.assertEqual(tensors["o"][1].shape, (6, 2, 8))

    def test_write_line_puts_raw_lines_on_the_protocol_stream_only(self):
        script = (
            "import sys; sys.path.insert(0, sys.argv[1]); import smallseq_adapter as kit\n"
            "print('to stderr, since the kit took stdout', flush=True) if kit.protocol_stream() else None\n"
            "kit.write_line('not a handshake')\n"
            "kit.write_line({'id': 7, 'ok': True})\n"
            "print('stray', flush=True)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", script, ADAPTERS], capture_output=True, text=True, timeout=60
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.splitlines(), ["not a handshake", '{"id": 7, "ok": true}'])
        self.assertIn("stray", proc.stderr)
        self.assertIn("to stderr", proc.stderr)


if __name__ == "__main__":
    unittest.main()
