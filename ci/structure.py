#!/usr/bin/env python3
"""The module structure of src/: files as rooms, `crate::` paths as arrows.

Prints the import circles (strongly connected components of more than one file) with their
sizes and the folders they span, and the largest files. With --check, exits 1 on any circle
(a newcomer reads the tree from the leaves up, which a circle makes impossible) or when a
source file exceeds --max-lines (kernels are not Rust files, so they are not counted).

    python3 ci/structure.py [--root src] [--check] [--max-lines 800]
"""
import argparse
import os
import re
import sys


def modules(root):
    """Module path (tuple) -> file path, for every .rs file under root."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            parts = rel[:-3].split(os.sep)
            if parts[-1] in ("mod", "lib", "main"):
                parts = parts[:-1]
            out[tuple(parts)] = os.path.join(dirpath, f)
    return out


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def use_targets(text):
    """Every `crate::a::b…` path the file names, `use` groups expanded one level."""
    paths = []
    for m in re.finditer(r"\bcrate((?:::\w+)+)(::\{([^;]*?)\})?", text, flags=re.S):
        head = m.group(1).strip(":").split("::")
        if m.group(3):
            for item in re.split(r",", m.group(3)):
                item = re.sub(r"\s+as\s+\w+", "", item).strip()
                if not item or item.startswith("{"):
                    paths.append(head)
                    continue
                paths.append(head + [p for p in re.split(r"::", item.split("{")[0]) if p])
        else:
            paths.append(head)
    return paths


def resolve(path, mods):
    """The deepest module that is a file and a prefix of `path`."""
    for n in range(len(path), -1, -1):
        if tuple(path[:n]) in mods:
            return tuple(path[:n])
    return None


def graph(root):
    mods = modules(root)
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        with open(f, encoding="utf-8") as fh:
            text = strip_comments(fh.read())
        # `super::x` relative to the module's parent
        for sm in re.finditer(r"\bsuper((?:::\w+)+)", text):
            parent = list(m[:-1])
            t = resolve(parent + sm.group(1).strip(":").split("::"), mods)
            if t is not None and t != m:
                edges[m].add(t)
        for p in use_targets(text):
            t = resolve(p, mods)
            # A parent module (`mod.rs`) named only as a path prefix is no arrow of its own
            # unless an item of it is used: `resolve` already takes the deepest file.
            if t is not None and t != m and t != ():
                edges[m].add(t)
    return mods, edges


def sccs(edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def folder(m, mods):
    return os.path.dirname(mods[m])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="src")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--max-lines", type=int, default=800)
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    mods, edges = graph(a.root)
    name = lambda m: "::".join(m) or "crate"
    arrows = sum(len(v) for v in edges.values())
    circles = sorted((c for c in sccs(edges) if len(c) > 1), key=len, reverse=True)
    print(f"rooms {len(mods)}, arrows {arrows}, circles {len(circles)}")
    bad = []
    for c in circles:
        folders = sorted({folder(m, mods) for m in c})
        print(f"circle of {len(c)} files over {len(folders)} folder(s): "
              + ", ".join(sorted(name(m) for m in c)))
        bad.append(f"a circle of {len(c)} files spans {', '.join(folders)}")
    sizes = []
    for m, f in mods.items():
        with open(f, encoding="utf-8") as fh:
            sizes.append((sum(1 for _ in fh), f))
    sizes.sort(reverse=True)
    print("largest files: " + ", ".join(f"{f} {n}" for n, f in sizes[: a.top]))
    for n, f in sizes:
        if n > a.max_lines:
            bad.append(f"{f} has {n} lines (more than {a.max_lines})")
    if a.check and bad:
        for b in bad:
            print("structure: " + b, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
