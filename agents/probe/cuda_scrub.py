"""Zero a GPU's free memory between tenants, through the CUDA driver API (libcuda).

CUDA does not clear memory it hands out ("The memory is not cleared":
``cuMemAlloc``), so a job could read what the previous tenant left on the GPU
(docs/reliability.md 2.2). After a job, the agent runs this in a child process with
``CUDA_VISIBLE_DEVICES=<uuid>``: it allocates the GPU's free memory in chunks,
writes zeros over all of it, waits for the GPU, and frees it. A child, not the
agent, so no CUDA context ever lives in the agent and a hang is killed by a
timeout. Only libcuda (part of the NVIDIA driver) is needed: no toolkit, no
compiler, no Python package.

    python -m agents.probe.cuda_scrub scrub
    python -m agents.probe.cuda_scrub fill PATTERN [--gib N]   # bench/gpu_check.sh: residue test G-03
    python -m agents.probe.cuda_scrub scan PATTERN [--gib N]

Each prints one JSON line; exit status 0 on success, 1 with ``{"error": ...}``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
MIN_CHUNK = 2 << 20  # stop halving below 2 MiB: what is left is the allocator's own


class CudaError(Exception):
    pass


class Cuda:
    """The few driver calls we need, with their C signatures."""

    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaError(f"libcuda.so.1 cannot be loaded (no NVIDIA driver on this machine?): {exc}") from None
        self.lib = lib
        ptr, size = ctypes.c_uint64, ctypes.c_size_t
        sig = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuCtxCreate_v2": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_int],
            "cuCtxDestroy_v2": [ctypes.c_void_p],
            "cuCtxSynchronize": [],
            "cuMemGetInfo_v2": [ctypes.POINTER(size), ctypes.POINTER(size)],
            "cuMemAlloc_v2": [ctypes.POINTER(ptr), size],
            "cuMemFree_v2": [ptr],
            "cuMemsetD8_v2": [ptr, ctypes.c_ubyte, size],
            "cuMemsetD32_v2": [ptr, ctypes.c_uint, size],
            "cuMemcpyDtoH_v2": [ctypes.c_void_p, ptr, size],
            "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int

    def __call__(self, name: str, *args) -> int:
        rc = getattr(self.lib, name)(*args)
        if rc not in (CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY):
            text = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(text))
            raise CudaError(f"{name} failed: {(text.value or b'?').decode()} ({rc})")
        return rc


class Gpu:
    """A context on device 0 (the one CUDA_VISIBLE_DEVICES names), and the chunks we hold."""

    def __init__(self, cuda: Cuda):
        self.cuda = cuda
        cuda("cuInit", 0)
        dev = ctypes.c_int()
        cuda("cuDeviceGet", ctypes.byref(dev), 0)
        self.ctx = ctypes.c_void_p()
        cuda("cuCtxCreate_v2", ctypes.byref(self.ctx), 0, dev)
        self.chunks: list[tuple[int, int]] = []

    def mem_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.cuda("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def grab(self, limit: int, chunk: int = 1 << 30) -> int:
        """Allocate up to ``limit`` bytes in chunks, halving the chunk when the GPU runs out."""
        held = 0
        while chunk >= MIN_CHUNK and held < limit:
            p = ctypes.c_uint64()
            size = min(chunk, limit - held)
            if self.cuda("cuMemAlloc_v2", ctypes.byref(p), size) == CUDA_ERROR_OUT_OF_MEMORY:
                chunk //= 2
                continue
            self.chunks.append((p.value, size))
            held += size
        return held

    def close(self) -> None:
        for p, _ in self.chunks:
            self.cuda("cuMemFree_v2", p)
        self.chunks.clear()
        self.cuda("cuCtxDestroy_v2", self.ctx)


def scrub() -> dict:
    gpu = Gpu(Cuda())
    t0 = time.monotonic()
    free, total = gpu.mem_info()
    held = gpu.grab(free)
    for p, size in gpu.chunks:
        gpu.cuda("cuMemsetD8_v2", p, 0, size)
    gpu.cuda("cuCtxSynchronize")
    gpu.close()
    return {"zeroed_bytes": held, "free_bytes": free, "total_bytes": total,
            "seconds": round(time.monotonic() - t0, 3)}


def fill(pattern: int, gib: float) -> dict:
    """The residue test's tenant A: write a 32-bit pattern over ``gib`` GiB and exit without clearing."""
    gpu = Gpu(Cuda())
    held = gpu.grab(int(gib * (1 << 30)))
    for p, size in gpu.chunks:
        gpu.cuda("cuMemsetD32_v2", p, pattern, size // 4)
    gpu.cuda("cuCtxSynchronize")
    gpu.close()
    return {"filled_bytes": held, "pattern": f"{pattern:#010x}"}


def scan(pattern: int, gib: float) -> dict:
    """The residue test's tenant B: allocate ``gib`` GiB (never written) and count the words
    that hold tenant A's pattern."""
    gpu = Gpu(Cuda())
    held = gpu.grab(int(gib * (1 << 30)))
    word = pattern.to_bytes(4, "little")
    buf = ctypes.create_string_buffer(64 << 20)
    matches = 0
    for p, size in gpu.chunks:
        for off in range(0, size, len(buf)):
            n = min(len(buf), size - off)
            gpu.cuda("cuMemcpyDtoH_v2", buf, p + off, n)
            matches += buf.raw[:n].count(word)
    gpu.close()
    return {"scanned_bytes": held, "pattern": f"{pattern:#010x}", "matches": matches}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.probe.cuda_scrub", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("scrub", help="zero all free memory of device 0")
    for name in ("fill", "scan"):
        p = sub.add_parser(name)
        p.add_argument("pattern", type=lambda s: int(s, 0), help="32-bit pattern, e.g. 0x5EC2E7A1")
        p.add_argument("--gib", type=float, default=8.0, help="GiB to fill or scan")
    args = ap.parse_args(argv)
    try:
        out = scrub() if args.cmd == "scrub" else fill(args.pattern, args.gib) if args.cmd == "fill" \
            else scan(args.pattern, args.gib)
    except CudaError as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
