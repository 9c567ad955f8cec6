#!/usr/bin/env python3
"""numpy_reference with a planted defect, for the tests of adapters/standalone.py and of
the campaign's judgement (tests/bias_cases.rs).

    python3 adapters/tests/planted.py --plant last-key|batch|dbias|undeclared-dbias

- last-key: slot 0's queries never see its last key (an off-by-one in the key length);
- batch: O is scaled by 1 + (slots - 1) / 64, so it changes when a batch is split;
- dbias: dBias is scaled by 5/4 (every other output is right);
- undeclared-dbias: no defect, but caps.dbias is left out, as in an adapter written before it:
  the campaign must not ask for dBias (the kit would refuse it as undeclared).

SMALLSEQ_PLANTED_DELAY=SECONDS makes every call that long at least, so that a test can
signal a triage while it replays (tests/triage.rs).
"""

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import numpy_reference  # noqa: E402
import smallseq_adapter as kit  # noqa: E402


def adapter(argv=None) -> kit.Adapter:
    ap = kit.arg_parser(__doc__)
    ap.add_argument("--plant", required=True, choices=["last-key", "batch", "dbias", "undeclared-dbias"])
    args = ap.parse_args([] if argv is None else argv)
    base = numpy_reference.adapter()
    delay = float(os.environ.get("SMALLSEQ_PLANTED_DELAY", "0"))

    def run(case, want):
        time.sleep(delay)
        if args.plant == "last-key" and case.skv.slots and case.skv.lens[0] > 1:
            lens = case.skv.lens.copy()
            lens[0] -= 1
            k_end = int(case.skv.starts[0] + lens[0])
            # the lost key moves into slot 0's gap: a don't-care token of the shorter slot
            offsets = case.skv.offsets.copy()
            cu = np.concatenate([[0], np.cumsum(lens)])
            skv = kit.make_side(cu, offsets, case.skv.tokens)
            assert int(skv.starts[0] + skv.lens[0]) == k_end
            case = kit.Case(case.config, case.q, case.k, case.v, case.d_o, case.sq, skv, case.meta)
        out = numpy_reference.attention(case, want)
        if args.plant == "batch":
            out["o"] = kit.round_to_dtype(out["o"] * (1 + (case.sq.slots - 1) / 64), case.config.dtype)
        if args.plant == "dbias" and kit.DBIAS in out:
            out[kit.DBIAS] = kit.round_to_dtype(out[kit.DBIAS] * 1.25, case.config.dtype)
        return out

    caps = dataclasses.replace(base.caps, dbias=False) if args.plant == "undeclared-dbias" else base.caps
    return kit.Adapter(f"planted-{args.plant}", "test", caps, run, dict(base.provenance),
                       no_key_lse=args.no_key_lse)


if __name__ == "__main__":
    sys.exit(kit.serve(adapter(sys.argv[1:])))
