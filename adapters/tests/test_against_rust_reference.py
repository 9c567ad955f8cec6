"""numpy_reference and the kit's case reader against the Rust f64 reference, on the case files
the Rust side wrote (tests/capsules): after rounding the Rust outputs once to the case dtype
(LSE to f32), every output must be bitwise equal. Runs when SMALLSEQ_BIN names the smallseq
binary (ci/adapters.sh sets it)."""

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
                    got = ref.attention(case, want)
                    for name in want:
                        exp = kit.round_to_dtype(rust[name][1], "f32" if name == "lse" else case.config.dtype)
                        np.testing.assert_array_equal(got[name], exp, err_msg=name)


if __name__ == "__main__":
    unittest.main()
