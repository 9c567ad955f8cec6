"""The checks of a standalone repro script (`adapters/standalone.py` embeds this file).

Given a case, an adapter (the implementation, called the way its smallseq adapter calls it)
and what the harness reported (property, detail, thresholds), `main` runs the
implementation, compares each output with the float64 reference of docs/semantics.md §1
(`numpy_reference.attention64`), replays the property's own relation where it has one (a
batch split, the slots reversed, a second run, poisoned don't-care tokens), prints the
largest discrepancy per tensor and returns 1 when the reported failure reproduces, 0 when it
does not, 2 when the implementation refused the case.

Errors are measured as the harness measures its tensor rule: `max |actual - expected|` over
valid elements, NaN counting as infinite and equal infinities as 0. The harness also grants
dQ and dK a per-element conditioning allowance (docs/judgement.md) that is not modelled
here, so a dq/dk error slightly over the threshold here may pass there.
"""

import re

import numpy as np

import numpy_reference
import smallseq_adapter as kit

GRADS = ("dq", "dk", "dv")


def thresholds(detail: str) -> dict:
    """Per tensor, the threshold a numeric_agreement detail names ("o: max error E >
    threshold T"), for every tensor it names."""
    pat = r"\b(o|lse|dq|dk|dv|dbias): max error (\S+) > threshold ([0-9.eE+-]+)"
    return {m.group(1): float(m.group(3)) for m in re.finditer(pat, detail)}


def row_thresholds(detail: str) -> dict:
    """Per tensor, the row rule's failures a numeric_agreement detail names ("dv: row (token
    24, head 0) error E > its threshold T"), as {tensor: (token, head, threshold)}."""
    pat = r"\b(o|lse|dq|dk|dv): row \(token (\d+), head (\d+)\) error \S+ > its threshold ([0-9.eE+-]+)"
    return {m.group(1): (int(m.group(2)), int(m.group(3)), float(m.group(4))) for m in re.finditer(pat, detail)}


def relation_limit(detail: str):
    """(tensor, limit) of a metamorphic detail compared to tolerance ("o of the launches
    differs from the base run by E > L"), or (None, 0.0) for a bitwise relation."""
    m = re.search(r"\b(o|lse|dq|dk|dv) of the launches differs from the base run by \S+ > ([0-9.eE+-]+)", detail)
    return (m.group(1), float(m.group(2))) if m else (None, 0.0)


def max_error(a, b, rows=None) -> float:
    """max |a - b| over `rows` (a bool mask of the first axis), NaN as infinite."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if rows is not None:
        a, b = a[rows], b[rows]
    if a.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):
        d = np.where(a == b, 0.0, np.abs(a - b))  # equal infinities agree
    d = np.where(np.isnan(d), np.inf, d)
    return float(d.max())


def first_difference(a, b, rows):
    """The first element (index tuple, a, b) where a and b differ bitwise within `rows`."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    diff = (a.view(np.uint32) != b.view(np.uint32)) & rows.reshape((-1,) + (1,) * (a.ndim - 1))
    idx = np.argwhere(diff)
    if not len(idx):
        return None
    i = tuple(int(x) for x in idx[0])
    return i, float(a[i]), float(b[i])


def valid_rows(case: kit.Case, name: str) -> np.ndarray:
    """The rows of `name` that hold values, as a bool mask of its first axis: tokens, or for
    dbias the bias's batch rows, all of them (the reference holds 0 where no slot reads an
    entry, so every entry is compared)."""
    if name == kit.DBIAS:
        return np.ones(case.bias.shape[0], bool)
    return (case.sq if name in ("o", "lse", "dq") else case.skv).valid()



def dont_care_off(case, outs):
    """Prints the first output of each tensor at a don't-care token that is not its fixed value
    (0, or -inf for lse); True if there is one."""
    hit = False
    for name in sorted(outs):
        dc = ~valid_rows(case, name)
        fill = -np.inf if name == "lse" else 0.0
        bad = np.argwhere(dc.reshape((-1,) + (1,) * (outs[name].ndim - 1)) & (outs[name] != fill))
        if len(bad):
            hit = True
            i = tuple(int(x) for x in bad[0])
            print(f"  don't-care {name}{list(i)} = {float(outs[name][i])!r}, expected {fill}")
    return hit

def wanted(adapter: kit.Adapter, case: kit.Case) -> frozenset:
    want = {"o"}
    if adapter.caps.lse:
        want.add("lse")
    if adapter.caps.backward and case.d_o is not None:
        want |= set(GRADS)
        if adapter.caps.dbias and case.bias is not None:
            want.add(kit.DBIAS)
    return frozenset(want)


def run(adapter: kit.Adapter, case: kit.Case, want: frozenset) -> dict:
    """The adapter's outputs as the worker would write them (shapes checked, the declared
    no-key LSE convention mapped), as f32."""
    outs, _ = kit.finish_outputs(case, adapter.run(case, want), want, adapter)
    return {n: np.asarray(a, np.float32) for n, a in outs.items()}


def judged_rows(adapter: kit.Adapter, case: kit.Case, name: str):
    """The rows of `name` the harness judges: valid ones, less the rows without keys when
    the adapter declares they hold something else (then gradients are not judged: None)."""
    rows = valid_rows(case, name)
    if adapter.caps.no_key_row != "zero" and case.no_key_rows().any():
        if name in GRADS or name == kit.DBIAS:
            return None
        rows = rows & ~case.no_key_rows()
    return rows


def sub_case(case: kit.Case, slots) -> tuple:
    """The slots `slots` of `case` as a packed case of their own, and the buffer rows (q, kv)
    of `case` that its tokens came from."""
    def side(s):
        lens = s.lens[slots]
        rows = np.concatenate([np.arange(s.starts[i], s.starts[i] + s.lens[i]) for i in slots]).astype(np.int64)
        return kit.make_side(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)), rows

    (sq, rq), (skv, rk) = side(case.sq), side(case.skv)
    d_o = case.d_o[rq] if case.d_o is not None else None
    # a bias of one row per slot goes with its slots; a broadcast one is every slot's
    bias = case.bias
    if bias is not None and bias.shape[0] > 1:
        bias = bias[list(slots)]
    sub = kit.Case(case.config, case.q[rq], case.k[rk], case.v[rk], d_o, sq, skv, dict(case.meta),
                   bias=bias, alibi_slopes=case.alibi_slopes)
    return sub, rq, rk


def check_rows(outs, ref, rows_reported) -> bool:
    """The row rule's failures the harness reported: each named row's largest error against
    the row's threshold; True if one is over."""
    hit = False
    for name, (token, head, limit) in sorted(rows_reported.items()):
        if name not in outs:
            continue
        err = max_error(outs[name][token, head], ref[name][token, head])
        over = err > limit
        hit |= over
        print(f"  {name:4}  row (token {token}, head {head}): {err:.4e}  {'>' if over else '<='} "
              f"its threshold {limit:.4e} reported by the harness")
    return hit


def compare(outs, ref, rows_of, detail, not_judged="") -> bool:
    """Prints each output's largest error against the reference over `rows_of(name)` (None:
    not judged, and why) and the named rows of a row-rule failure; True where an error is
    over the threshold the harness reported in `detail`."""
    reported = thresholds(detail)
    print("largest discrepancy to the float64 reference (valid elements):")
    hit = False
    for name in kit.WANT_NAMES:
        if name not in outs or name not in ref:
            continue
        rows = rows_of(name)
        if rows is None:
            print(f"  {name:4}  not judged: {not_judged}")
            continue
        err = max_error(outs[name], ref[name], rows)
        line = f"  {name:4}  {err:.4e}"
        if name in reported:
            over = err > reported[name]
            hit |= over
            line += f"  {'>' if over else '<='} threshold {reported[name]:.4e} reported by the harness"
        print(line)
    return check_rows(outs, ref, row_thresholds(detail)) or hit


def check_reference(adapter, case, outs, detail) -> bool:
    ref = numpy_reference.attention64(case, frozenset(outs))
    why = f"rows without keys hold what the implementation declares ({adapter.caps.no_key_row})"
    return compare(outs, ref, lambda name: judged_rows(adapter, case, name), detail, why)


def check_slots(adapter, case, base, want, parts, limit, tensor_limited) -> bool:
    hit = False
    for slots in parts:
        sub, rq, rk = sub_case(case, slots)
        got = run(adapter, sub, want)
        for name in sorted(got):
            if name == kit.DBIAS:
                # a broadcast bias's dBias sums over the slots: a part of them has no
                # counterpart in the whole batch's
                if case.bias.shape[0] == 1:
                    continue
                rows_full = list(slots)
            else:
                rows_full = rq if name in ("o", "lse", "dq") else rk
            rows = judged_rows(adapter, sub, name)
            if rows is None:
                continue
            a, b = base[name][rows_full][rows], got[name][rows]
            if limit is None:
                d = first_difference(a, b, np.ones(a.shape[0], bool))
                if d is not None:
                    hit = True
                    print(f"  slots {list(slots)}: {name}{list(d[0])}: {d[1]!r} (whole batch) vs {d[2]!r} (alone)")
            else:
                err = max_error(a, b)
                over = err > limit and (tensor_limited is None or name == tensor_limited)
                hit |= over
                print(f"  slots {list(slots)}: {name} differs by {err:.4e}" + (f" > {limit:.4e} reported" if over else ""))
    return hit


def print_differences(case, base, again, prefix, suffix) -> bool:
    """Prints each tensor's first valid element where `again` differs from `base`; True if any."""
    hit = False
    for name in sorted(base):
        d = first_difference(base[name], again[name], valid_rows(case, name))
        if d is not None:
            hit = True
            print(f"{prefix}{name}{list(d[0])}: {d[1]!r} vs {d[2]!r}{suffix}")
    return hit


def check_relation(adapter, case, base, want, prop, detail) -> bool:
    """Replays the property's relation; True when it fails as the harness reported."""
    b = case.sq.slots
    if prop == "determinism":
        print("a second run of the same case:")
        again = run(adapter, case, want)
        return print_differences(case, base, again, "  ", "")
    if prop == "dont_care":
        print("the same case with NaN in every don't-care input token:")
        poisoned = kit.Case(case.config, case.q.copy(), case.k.copy(), case.v.copy(),
                            None if case.d_o is None else case.d_o.copy(), case.sq, case.skv, case.meta)
        for x, side in ((poisoned.q, case.sq), (poisoned.k, case.skv), (poisoned.v, case.skv), (poisoned.d_o, case.sq)):
            if x is not None:
                x[~side.valid()] = np.nan
        again = run(adapter, poisoned, want)
        hit = print_differences(case, base, again, "  valid ", " with poison")
        return dont_care_off(case, base) or hit
    if prop == "metamorphic" and ("splitting" in detail or "reversing" in detail) and b >= 2:
        tensor, limit = relation_limit(detail)
        if "splitting" in detail:
            cut = b // 2
            parts, what = [list(range(cut)), list(range(cut, b))], "the batch split in two launches"
        else:
            parts, what = [list(range(b - 1, -1, -1))], "the slots reversed"
        print(f"{what}, compared with the whole batch's rows" + (f" (limit {limit:.4e})" if tensor else " (bitwise)") + ":")
        return check_slots(adapter, case, base, want, parts, limit if tensor else None, tensor)
    print(f"({prop}: this script replays no relation for it; the reference comparison above is all)")
    return False


def main(adapter: kit.Adapter, case: kit.Case, verdict: dict) -> int:
    prop = verdict.get("property") or "numeric_agreement"
    detail = verdict.get("detail") or ""
    kit.start(adapter)
    print(f"implementation: {adapter.name} ({adapter.version}); no-key LSE declared {adapter.no_key_lse}")
    for k, v in sorted(adapter.provenance.items()):
        print(f"  {k}: {v}")
    print(f"reported: {prop}: {detail}")
    c = case.config
    print(f"case: {c.dtype}, {c.num_heads}/{c.num_kv_heads} heads, d {c.head_dim_qk}/{c.head_dim_v}, {c.mask}, "
          f"window {list(c.window)}, scale {c.scale!r}; q lens {case.sq.lens.tolist()}, kv lens {case.skv.lens.tolist()}")
    why = adapter.caps.outside(case)
    if why:
        print(f"not run: {why}")
        return 2
    want = wanted(adapter, case)
    try:
        base = run(adapter, case, want)
    except kit.WorkerError as e:
        print(f"the implementation refused the case ({e.kind}): {e}")
        return 2
    hit = check_reference(adapter, case, base, detail)
    if prop != "numeric_agreement":
        try:
            hit = check_relation(adapter, case, base, want, prop, detail)
        except kit.WorkerError as e:
            print(f"the implementation refused a derived case ({e.kind}): {e}")
            return 2
    print("REPRODUCED" if hit else "not reproduced")
    return 1 if hit else 0


def main_recorded(case: kit.Case, outs: dict, verdict: dict, backend: str) -> int:
    """The standalone check of a capsule from smallseq's own backends (`cpu`, `cuda`,
    `hip`), where no framework exists to call: the outputs the backend stored are compared
    with the float64 reference. A relation property reran the backend, which this script
    cannot; it says so and checks the stored outputs only."""
    prop = verdict.get("property") or "numeric_agreement"
    detail = verdict.get("detail") or ""
    print(f"outputs recorded by smallseq's {backend} backend (no framework to call: the script checks them)")
    print(f"reported: {prop}: {detail}")
    c = case.config
    print(f"case: {c.dtype}, {c.num_heads}/{c.num_kv_heads} heads, d {c.head_dim_qk}/{c.head_dim_v}, {c.mask}, "
          f"window {list(c.window)}, scale {c.scale!r}; q lens {case.sq.lens.tolist()}, kv lens {case.skv.lens.tolist()}")
    ref = numpy_reference.attention64(case, frozenset(outs))
    hit = compare(outs, ref, lambda name: valid_rows(case, name), detail)
    if prop == "dont_care":
        hit = dont_care_off(case, outs) or hit
    elif prop != "numeric_agreement":
        print(f"({prop} compares reruns of the backend, which this script cannot make: the stored outputs above are all it checks)")
    print("REPRODUCED" if hit else "not reproduced")
    return 1 if hit else 0


def case_from(config: str, tensors: dict, cu: dict, tokens: dict) -> kit.Case:
    """A case from the embedded data: `tensors` name -> (shape, f32 little-endian hex),
    `cu` name -> list (cu_seqlens_q/kv and, where present, the padded offsets)."""
    cfg = kit.parse_config(config)

    def arr(name):
        if name not in tensors:
            return None
        shape, hexdata = tensors[name]
        return np.frombuffer(bytes.fromhex(hexdata), "<f4").reshape(shape).copy()

    def side(w):
        return kit.make_side(cu[f"cu_seqlens_{w}"], cu.get(f"cu_seqlens_{w}_padded"), tokens[w], w)

    return kit.Case(cfg, arr("q"), arr("k"), arr("v"), arr("d_o"), side("q"), side("kv"), {},
                    bias=arr("bias"), alibi_slopes=arr("alibi_slopes"))

