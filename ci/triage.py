#!/usr/bin/env python3
"""Helpers of ci/h200-triage.sh, on a campaign's report.json (stdlib only).

    python3 ci/triage.py line NAME REPORT_JSON     one status line of a (partial) campaign
    python3 ci/triage.py kinds REPORT_JSON [MAX]   distinct failure kinds with a shrunk capsule:
                                                   "kind<TAB>count<TAB>smallest shrunk capsule"

A failure's kind is its property and its detail with the numbers and indices taken out
("numeric_agreement: o: max error # > threshold # (emulation error #)"), so the many cases
of one defect become one standalone script.
"""

import json
import os
import re
import sys


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def kind(failure) -> str:
    detail = re.sub(r"-?\d+(\.\d+)?(e[+-]?\d+)?", "#", failure.get("detail", ""))
    detail = re.sub(r"\[[#, ]+\]", "[#]", detail)
    return f"{failure.get('property')}: {detail[:160]}"


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


def kinds(path, most=8):
    r = load(path) or {}
    groups = {}
    for f in r.get("failures", []):
        cap = f.get("shrunk_capsule")
        if not cap or not os.path.exists(cap):
            continue
        groups.setdefault(kind(f), []).append(cap)
    ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))[:most]
    return [(k, len(caps), min(caps, key=os.path.getsize)) for k, caps in ranked]


def main(argv) -> int:
    if len(argv) >= 3 and argv[0] == "line":
        print(line(argv[1], argv[2]))
        return 0
    if len(argv) >= 2 and argv[0] == "kinds":
        for k, n, cap in kinds(argv[1], int(argv[2]) if len(argv) > 2 else 8):
            print(f"{k}\t{n}\t{cap}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
