#!/usr/bin/env python3
"""Writes a standalone Python script that reproduces a capsule's failure without smallseq.

    python3 adapters/standalone.py CAPSULE --adapter NAME|PATH [adapter flags ...] [-o FILE]
    python3 adapters/standalone.py CAPSULE --recorded [-o FILE]

CAPSULE is a (shrunk) failure capsule, or a campaign directory / capsules directory holding
exactly one shrunk capsule. NAME is an adapter of this directory (`torch_sdpa`,
`jax_attention`, ...); the flags after it are the adapter's own (`--kernel flash`). The script
(stdout, or FILE) needs numpy and the implementation's framework only: it embeds the case's
tensors (f32 bits, hex), the adapter's code and the kit's conversions unchanged (so the
implementation is called exactly as the campaign called it), a float64 numpy reference of
docs/semantics.md §1 and the checks of `repro_checks.py`. It prints the largest discrepancy per
tensor, whether it exceeds the threshold the harness reported, replays the failed relation
(split, reversal, rerun, poisoned don't-care tokens), and exits 1 if the failure reproduces,
0 if not, 2 if the implementation refused the case, 3 if the script itself failed.

With --recorded (a capsule of smallseq's own backends, cpu, cuda or hip, where no framework
exists to call) the script embeds the outputs the capsule recorded instead of an adapter and
checks them against the same reference; it needs numpy only.
"""

import argparse
import glob
import json
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import smallseq_adapter as kit  # noqa: E402

# Embedded in this order: each may import the ones before it.
SUPPORT = ("smallseq_adapter", "numpy_reference", "repro_checks")


def find_capsule(path: str) -> str:
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(path, "**", "*-shrunk.safetensors"), recursive=True))
    if len(found) != 1:
        names = ", ".join(os.path.basename(f) for f in found[:8]) or "none"
        raise SystemExit(f"standalone: {path} holds {len(found)} shrunk capsules ({names}); name one")
    return found[0]


def adapter_source(name: str) -> tuple:
    """(module name, source) of an adapter given by name or path."""
    path = name if name.endswith(".py") else os.path.join(HERE, f"{name}.py")
    if not os.path.isfile(path):
        raise SystemExit(f"standalone: no adapter {name} ({path} does not exist)")
    with open(path, encoding="utf-8") as f:
        return os.path.splitext(os.path.basename(path))[0], f.read()


def quoted(text: str) -> str:
    """`text` as a Python literal that keeps it readable where it can."""
    if "'''" not in text and not text.endswith("\\"):
        return "r'''" + text + "'''"
    return repr(text)


def case_data(case: kit.Case) -> tuple:
    tensors = {}
    # the bias of semantics.md §1.9 too: without it the script would run another case
    for name in kit.INPUT_NAMES + kit.BIAS_NAMES:
        arr = getattr(case, name)
        if arr is not None:
            a = np.ascontiguousarray(arr, dtype="<f4")
            tensors[name] = (list(a.shape), a.tobytes().hex())
    cu = {"cu_seqlens_q": case.sq.cu.tolist(), "cu_seqlens_kv": case.skv.cu.tolist()}
    if case.sq.padded:
        cu["cu_seqlens_q_padded"] = case.sq.offsets.tolist()
    if case.skv.padded:
        cu["cu_seqlens_kv_padded"] = case.skv.offsets.tolist()
    return tensors, cu, {"q": case.sq.tokens, "kv": case.skv.tokens}


def recorded_outputs(capsule: str) -> dict:
    """The outputs a capsule stores, as f32 (shape, hex) like the inputs."""
    tensors, _ = kit.read_safetensors(capsule)
    out = {}
    for name in kit.WANT_NAMES:
        if name in tensors:
            a = np.ascontiguousarray(tensors[name][1], dtype="<f4")
            out[name] = (list(a.shape), a.tobytes().hex())
    return out


def hex_lines(tensors: dict) -> list:
    lines = []
    for name, (shape, hexdata) in tensors.items():
        lines.append(f"    {name!r}: ({shape}, (")
        for i in range(0, len(hexdata), 96):
            lines.append(f"        {hexdata[i:i + 96]!r}")
        lines.append("    )),")
    return lines


def script(capsule: str, adapter_name, adapter_argv: list) -> str:
    case = kit.read_case(capsule)
    verdict = json.loads(case.meta.get("smallseq.verdict", "{}") or "{}")
    backend = case.meta.get("smallseq.backend", "unknown")
    recorded = adapter_name is None
    if recorded:
        module, source = "recorded", None
    else:
        module, source = adapter_source(adapter_name)
    sources = {}
    for name in SUPPORT:
        with open(os.path.join(HERE, f"{name}.py"), encoding="utf-8") as f:
            sources[name] = f.read()
    # the adapter after the kit and the reference it may import, before the checks
    checks = sources.pop("repro_checks")
    if source is not None:
        sources[module] = source
    sources["repro_checks"] = checks
    tensors, cu, tokens = case_data(case)
    prov = case.meta.get("smallseq.provenance", "")
    how = ["--recorded"] if recorded else ["--adapter", adapter_name] + adapter_argv
    command = shlex.join(["python3", "adapters/standalone.py", os.path.basename(capsule)] + how)
    on = f"the {backend} backend's recorded outputs" if recorded else f"{module} {' '.join(adapter_argv)}".strip()
    what = [
        "Checks the outputs smallseq's own backend stored in the capsule (embedded below; no",
        "framework exists to call) against the float64 reference of the attention semantics in",
        "numpy and prints the largest discrepancy per tensor. Exit status: 1 reproduced, 0 not",
        "reproduced, 3 this script failed. Needs numpy only; not smallseq.",
    ] if recorded else [
        "Runs the implementation on the case below exactly as the smallseq adapter did (its code",
        "and the adapter kit's conversions are embedded unchanged), computes the float64 reference",
        "of the attention semantics in numpy, prints the largest discrepancy per tensor and replays",
        "the failed relation. Exit status: 1 reproduced, 0 not reproduced, 2 the case was refused,",
        "3 this script failed.",
        "Needs numpy and the implementation's framework; not smallseq.",
    ]
    lines = [
        "#!/usr/bin/env python3",
        '"""Standalone repro of a smallseq capsule: ' + f"{verdict.get('property')} on {on}",
        "",
        f"Capsule: {os.path.basename(capsule)} (written by: {backend}).",
        f"Reported: {verdict.get('detail')}",
        "",
    ] + what + [
        f"Generated by: {command}",
        '"""',
        "",
        "import sys",
        "import traceback",
        "import types",
        "",
        "SOURCES = {}",
    ]
    for name, text in sources.items():
        lines.append(f"SOURCES[{name!r}] = {quoted(text)}")
    lines += [
        "",
        f"CONFIG = {case.config.to_json()!r}",
        f"CU_SEQLENS = {cu!r}",
        f"TOKENS = {tokens!r}",
        f"VERDICT = {verdict!r}",
        f"CAPSULE_PROVENANCE = {prov!r}",
        f"ADAPTER = {module!r}",
        f"ADAPTER_ARGV = {adapter_argv!r}",
        f"BACKEND = {backend!r}",
        "# inputs: name -> (shape, float32 little-endian bytes as hex; values exact in the case dtype)",
        "TENSORS = {",
    ] + hex_lines(tensors) + [
        "}",
        "# the outputs the capsule recorded (--recorded only): name -> (shape, float32 hex)",
        "RECORDED = {",
    ] + (hex_lines(recorded_outputs(capsule)) if recorded else []) + [
        "}",
        "",
        "",
        "def load(name):",
        "    mod = types.ModuleType(name)",
        "    mod.__file__ = __file__",
        "    sys.modules[name] = mod",
        "    exec(compile(SOURCES[name], name + '.py', 'exec'), mod.__dict__)",
        "    return mod",
        "",
        "",
        "def main():",
        "    for name in SOURCES:",
        "        load(name)",
        "    checks = sys.modules['repro_checks']",
        "    tensors = {k: (shape, ''.join(parts)) for k, (shape, parts) in TENSORS.items()}",
        "    case = checks.case_from(CONFIG, tensors, CU_SEQLENS, TOKENS)",
        "    print('capsule provenance:', CAPSULE_PROVENANCE)",
        "    if ADAPTER == 'recorded':",
        "        import numpy as np",
        "        outs = {k: np.frombuffer(bytes.fromhex(''.join(parts)), '<f4').reshape(shape)",
        "                for k, (shape, parts) in RECORDED.items()}",
        "        return checks.main_recorded(case, outs, VERDICT, BACKEND)",
        "    return checks.main(sys.modules[ADAPTER].adapter(ADAPTER_ARGV), case, VERDICT)",
        "",
        "",
        "if __name__ == '__main__':",
        "    try:",
        "        status = main()",
        "    except Exception:  # exit 1 means 'reproduced': a crash of this script must not read so",
        "        traceback.print_exc()",
        "        status = 3",
        "    except SystemExit as e:  # the adapter gave up before the case ran (SystemExit('...') is 1)",
        "        print(f'the implementation did not start: {e.code}', file=sys.stderr)",
        "        status = 3",
        "    sys.exit(status)",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("capsule")
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--adapter", help="adapter name in adapters/ or a path to one")
    how.add_argument("--recorded", action="store_true",
                     help="check the outputs the capsule recorded (smallseq's own backends: no framework to call)")
    ap.add_argument("-o", "--output", help="write the script here (default: stdout)")
    args, adapter_argv = ap.parse_known_args(argv)
    if args.recorded and adapter_argv:
        ap.error(f"--recorded takes no adapter flags ({' '.join(adapter_argv)})")
    text = script(find_capsule(args.capsule), None if args.recorded else args.adapter, adapter_argv)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(args.output, 0o755)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
