"""bench/peers_jax.py's device timer on a made-up trace: each annotated call's span runs from its
first device kernel's start to its last one's end, host events and kernels outside any call
(the L2 flush) do not count, and a call without kernels is left out. Plain Python (no JAX).

    python3 -m unittest discover -s bench -p 'test_*.py'
"""
import os
import sys
import unittest

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers_jax as J  # noqa: E402


def meta(pid, name):
    return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}


def x(pid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": 1, "name": name, "ts": ts, "dur": dur}


class DeviceSpans(unittest.TestCase):
    def test_each_call_spans_its_own_kernels(self):
        host, gpu, other = 1, 2, 3
        events = [
            meta(host, "/host:CPU"), meta(gpu, "/device:GPU:0"), meta(other, "/device:TPU:0"),
            x(gpu, "flush", 0, 50),  # before the first call: the L2 write
            x(host, J.CALL_MARK + "0", 100, 80),
            x(host, "PjitFunction", 101, 20),  # host work inside the call: not device time
            x(gpu, "fusion_1", 110, 10), x(gpu, "gemm", 125, 30),
            x(other, "not a GPU", 112, 500),
            x(gpu, "flush", 190, 40),
            x(host, J.CALL_MARK + "1", 250, 60),
            x(gpu, "fusion_1", 260, 12),
            x(host, J.CALL_MARK + "2", 400, 30),  # no kernel: left out
        ]
        self.assertEqual(J.device_spans(events, J.CALL_MARK, J.is_gpu_process), [45.0, 12.0])

    def test_no_device_process_gives_no_spans(self):
        events = [meta(1, "/host:CPU"), x(1, J.CALL_MARK + "0", 0, 10), x(1, "op", 2, 3)]
        self.assertEqual(J.device_spans(events, J.CALL_MARK, J.is_gpu_process), [])


if __name__ == "__main__":
    unittest.main()
