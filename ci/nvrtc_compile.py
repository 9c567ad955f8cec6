#!/usr/bin/env python3
"""Compiles kernels/*.cu with NVRTC exactly as the CUDA backend does (portable.h inlined,
--gpu-architecture=ARCH --std=c++17 -lineinfo, optional -D defines), writes the PTX and runs
ptxas -v on it, so kernel errors, register counts and spills show up without a GPU.

usage: nvrtc_compile.py TOOLS_DIR OUT_DIR ARCH [DEFINE ...]
TOOLS_DIR holds nvidia/cuda_nvrtc/lib/libnvrtc.so.12 and nvidia/cuda_nvcc/bin/ptxas (the PyPI
wheels nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvcc-cu12, unpacked by ci/cuda-compile-check.sh).
"""
import ctypes
import os
import re
import subprocess
import sys


def nvrtc_ptx(lib, name, src, opts):
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
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    check(lib, lib.nvrtcGetPTX(prog, ptx))
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode(), log.value.decode()


def check(lib, rc):
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit(f"NVRTC error {rc}: {lib.nvrtcGetErrorString(rc).decode()}")


def main():
    tools, out, arch, defines = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    lib = ctypes.CDLL(os.path.join(tools, "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
    ptxas = os.path.join(tools, "nvidia/cuda_nvcc/bin/ptxas")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels")
    portable = open(os.path.join(root, "portable.h")).read()
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "-lineinfo"] + [f"-D{d}" for d in defines]
    os.makedirs(out, exist_ok=True)
    worst_spill = 0
    for name in ("small_seq.cu", "fallback.cu"):
        src = open(os.path.join(root, name)).read().replace('#include "portable.h"', portable)
        # A define the source never names leaves its preprocessed text, and so its PTX, as the
        # plain build's: nothing new to compile.
        names = [d.split("=")[0] for d in defines]
        if names and not any(re.search(rf"\b{re.escape(n)}\b", src) for n in names):
            print(f"{name}: does not name {' '.join(names)}; its PTX is the plain build's")
            continue
        ptx, log = nvrtc_ptx(lib, name, src, opts)
        if log.strip():
            print(log.strip())
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
    print(f"{arch} {' '.join(defines) or '(no defines)'}: compiled, worst spill {worst_spill} bytes")


if __name__ == "__main__":
    main()
