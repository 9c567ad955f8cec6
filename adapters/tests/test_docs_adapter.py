"""The adapters shown in README.md and docs/adapters.md run as written, against a numpy
`mylib` whose `varlen_attention` is the f64 reference."""

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import unittest

import numpy as np

from casegen import kit, make_case

import numpy_reference  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MYLIB = textwrap.dedent('''
    import numpy as np
    import numpy_reference
    import smallseq_adapter as kit

    def varlen_attention(q, k, v, cu_q, cu_kv, max_q, max_kv, scale, causal):
        mask = "causal_bottom_right" if causal else "padding"
        cfg = kit.Config("f32", q.shape[1], k.shape[1], q.shape[2], v.shape[2], mask, (-1, -1), scale)
        sq, skv = kit.make_side(cu_q), kit.make_side(cu_kv)
        assert max_q == sq.max_len and max_kv == skv.max_len
        case = kit.Case(cfg, q, k, v, None, sq, skv, {})
        out = numpy_reference.attention64(case, frozenset(["o", "lse"]))
        lse = np.where(case.no_key_rows()[:, None], np.inf, out["lse"])  # a flash-style kernel
        return out["o"], lse.T
''')


def adapter_blocks(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "kit.serve" in b]


class DocsAdapter(unittest.TestCase):
    def test_the_documented_adapters_answer_a_request(self):
        for doc in ("README.md", "docs/adapters.md"):
            (block,) = adapter_blocks(doc)
            with tempfile.TemporaryDirectory() as d:
                code = block.replace("/path/to/smallseq/adapters", os.path.join(ROOT, "adapters"))
                with open(os.path.join(d, "my_adapter.py"), "w") as f:
                    f.write(code)
                with open(os.path.join(d, "mylib.py"), "w") as f:
                    f.write(MYLIB)
                case = make_case([3, 2], [1, 4], dtype="bf16", heads=2, dqk=64, mask="causal_bottom_right",
                                 gaps_q=[1, 0], backward=False)
                path = os.path.join(d, "c.in.safetensors")
                kit.write_case(path, case)
                req = {"id": 1, "op": "run", "case": path, "out": os.path.join(d, "c.out.safetensors"),
                       "want": ["o", "lse"], "env": {}}
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([d, os.path.join(ROOT, "adapters")]))
                r = subprocess.run([sys.executable, os.path.join(d, "my_adapter.py")], input=json.dumps(req) + "\n",
                                   capture_output=True, text=True, env=env, timeout=60)
                hs, reply = (json.loads(x) for x in r.stdout.splitlines())
                self.assertEqual(hs["name"], "mylib-varlen", doc)
                self.assertTrue(reply["ok"], f"{doc}: {reply} {r.stderr[-2000:]}")
                got = kit.read_safetensors(req["out"])[0]
                want = numpy_reference.attention64(case, frozenset(["o", "lse"]))
                valid = case.sq.valid()
                np.testing.assert_allclose(got["o"][1][valid], want["o"][valid], rtol=1e-6, atol=1e-6, err_msg=doc)
                # rows without a key: the kernel's +inf mapped to -inf, as declared
                np.testing.assert_array_equal(got["lse"][1][case.no_key_rows()], -np.inf, err_msg=doc)
                np.testing.assert_array_equal(got["o"][1][~valid], 0.0, err_msg=doc)


if __name__ == "__main__":
    unittest.main()
