#!/usr/bin/env python3
"""Compiles kernels/*.cu with NVRTC exactly as the CUDA backend does (portable.h inlined,
--gpu-architecture=ARCH --std=c++17 -lineinfo, optional -D defines), writes the PTX and runs
ptxas -v on it, so kernel errors, register counts and spills show up without a GPU.

usage: nvrtc_compile.py [--front-end] TOOLS_DIR OUT_DIR ARCH [DEFINE ...]
With --front-end, NVRTC stops after its front end (--fdevice-syntax-only: preprocessing,
parsing, semantic analysis and the instantiation of every template the kernels use) and no PTX
is made: what a mutant define can break, in 0.1 s instead of the 40 s of a full build.
TOOLS_DIR holds nvidia/cuda_nvrtc/lib/libnvrtc.so.12 and nvidia/cuda_nvcc/bin/ptxas (the PyPI
wheels nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvcc-cu12, unpacked by ci/cuda-compile-check.sh).
"""
import ctypes
import os
import re
import subprocess
import sys


def nvrtc_ptx(lib, name, src, opts, want_ptx=True):
    prog = ctypes.c_void_p()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None))
    argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(f"NVRTC failed on {name} ({' '.join(opts)}):\n{log.value.decode()}")
    if not want_ptx:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return "", log.value.decode()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    check(lib, lib.nvrtcGetPTX(prog, ptx))
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode(), log.value.decode()


def front_end_sees_errors(lib, opts):
    """A front-end-only compile is worth something only if it fails a source with an error in a
    template instantiated by a kernel, where a mutant define's mistakes would be."""
    bad = ("template <int N> __device__ float f(float x) { return x.no_member; }\n"
           'extern "C" __global__ void k(float* x) { x[0] = f<2>(x[1]); }\n')
    try:
        nvrtc_ptx(lib, "control.cu", bad, opts, want_ptx=False)
    except SystemExit:
        return  # refused, as it must be
    sys.exit(f"NVRTC's front end ({' '.join(opts)}) passed a source with an error: "
             "a front-end check would see nothing")


def check(lib, rc):
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit(f"NVRTC error {rc}: {lib.nvrtcGetErrorString(rc).decode()}")


def main():
    args = sys.argv[1:]
    front_end = bool(args) and args[0] == "--front-end"
    if front_end:
        args = args[1:]
    if len(args) < 3:
        sys.exit(__doc__)
    tools, out, arch, defines = args[0], args[1], args[2], args[3:]
    lib = ctypes.CDLL(os.path.join(tools, "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
    ptxas = os.path.join(tools, "nvidia/cuda_nvcc/bin/ptxas")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels")
    portable = open(os.path.join(root, "portable.h")).read()
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "-lineinfo"] + [f"-D{d}" for d in defines]
    if front_end:
        opts.append("--fdevice-syntax-only")
    os.makedirs(out, exist_ok=True)
    if front_end:
        front_end_sees_errors(lib, opts)
    worst_spill = 0
    for name in ("small_seq.cu", "fallback.cu"):
        src = open(os.path.join(root, name)).read().replace('#include "portable.h"', portable)
        # A define the source never names leaves its preprocessed text, and so its PTX, as the
        # plain build's: nothing new to compile.
        names = [d.split("=")[0] for d in defines]
        if names and not any(re.search(rf"\b{re.escape(n)}\b", src) for n in names):
            print(f"{name}: does not name {' '.join(names)}; its PTX is the plain build's")
            continue
        ptx, log = nvrtc_ptx(lib, name, src, opts, want_ptx=not front_end)
        if log.strip():
            print(log.strip())
        if front_end:
            print(f"{name}: front end passed")
            continue
        ptx_path = os.path.join(out, name.replace(".cu", ".ptx"))
        open(ptx_path, "w").write(ptx)
        res = subprocess.run([ptxas, f"-arch={arch}", "-v", "-o", os.devnull, ptx_path],
                             capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"ptxas failed on {name}:\n{res.stderr}")
        # ptxas reports per function, in order: the entry name, its stack frame and spills,
        # then its registers.
        func, stack, spill = None, 0, 0
        for line in res.stderr.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                func, stack, spill = m.group(1), 0, 0
            m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line)
            if m:
                stack, spill = int(m.group(1)), int(m.group(2))
            m = re.search(r"Used (\d+) registers", line)
            if m and func:
                worst_spill = max(worst_spill, spill)
                print(f"{func:40} regs {m.group(1):>3}  stack {stack:>4}  spill {spill}")
    what = "front end passed" if front_end else f"compiled, worst spill {worst_spill} bytes"
    print(f"{arch} {' '.join(defines) or '(no defines)'}: {what}")


if __name__ == "__main__":
    main()
