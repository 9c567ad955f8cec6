#!/usr/bin/env python3
"""Helpers of ci/h200-triage.sh, on a campaign's report.json (stdlib only).

    python3 ci/triage.py line NAME REPORT_JSON      one status line of a (partial) campaign
    python3 ci/triage.py scripts TRIAGE_JSON [MAX]  the groups `smallseq triage` wrote, largest
                                                    first: "id<TAB>count<TAB>verdict<TAB>script
                                                    <TAB>signature" (script "-" where none)

Grouping failures by kind (property, tensor, case class and the detail with its numbers taken
out), shrinking a representative, writing its standalone script and giving it a verdict is
`smallseq triage`'s (src/harness/triage.rs); this file only reads what it wrote.
"""

import json
import sys


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def line(name, path) -> str:
    r = load(path)
    if r is None:
        return f"{name}: no report yet"
    fails = {p: c["fail"] for p, c in r.get("properties", {}).items() if c.get("fail")}
    shrunk = sum(1 for f in r.get("failures", []) if f.get("shrunk_capsule"))
    o = r.get("protocol_overhead_us")
    over = f", protocol overhead median {o['p50']:.0f} us p90 {o['p90']:.0f} us" if o else ""
    state = " (partial)" if r.get("partial") else ""
    return (f"{name}{state}: {r.get('cases', 0)} cases in {r.get('elapsed_s', 0):.0f} s "
            f"({r.get('cases_per_s', 0):.1f} cases/s, {r.get('jobs')} jobs){over}; "
            f"failures {json.dumps(fails) if fails else 'none'}, {shrunk} shrunk")


def scripts(path, most=8):
    t = load(path) or {}
    rows = []
    for i, g in enumerate(t.get("groups", [])[:most], 1):
        sig = g.get("signature", {})
        what = f"{sig.get('property')} {sig.get('tensor')} [{sig.get('class')}]: {sig.get('pattern')}"
        rows.append((i, g.get("count", 0), g.get("finding", {}).get("verdict", "?"), g.get("script") or "-", what))
    return rows


def main(argv) -> int:
    if len(argv) >= 3 and argv[0] == "line":
        print(line(argv[1], argv[2]))
        return 0
    if len(argv) >= 2 and argv[0] == "scripts":
        for row in scripts(argv[1], int(argv[2]) if len(argv) > 2 else 8):
            print("\t".join(str(x) for x in row))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
