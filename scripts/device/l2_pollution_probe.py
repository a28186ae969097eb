"""Device probe: do L2 evict_last stores (the fidelity dequantize's scratch weight) hold the L2 afterwards?

A kernel that only reads a 20 MiB tensor (fits the H100's 50 MiB L2 when the L2 is free, not when 34 MiB of it
are held) is timed after the scratch has been written
* ``none``: by a dequantize-like store without a hint;
* ``evict_last``: with the L2 evict_last hint;
* ``evict_last+normal``: with the hint, then every line of the scratch set back to evict_normal
  (``applypriority.global.L2::evict_normal``, one small kernel);
* ``evict_last+discard``: with the hint, then the scratch's lines discarded (``discard.global.L2``: no write-back).
Mean of ``--reps`` sums queued back to back, median over 5 rounds; the store pass is re-run before each
measurement. Also times the two clean-up kernels themselves.
    python scripts/device/l2_pollution_probe.py
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _pack  # noqa: E402,F401
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _fill_kernel(o_ptr, n, val, BLOCK: tl.constexpr, POLICY: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + offs, tl.full((BLOCK,), val, tl.bfloat16), mask=offs < n, eviction_policy=POLICY)


@triton.jit
def _line_op_kernel(p_ptr, nlines, OP: tl.constexpr, LINES: tl.constexpr):
    """One thread per 128-byte L2 line: OP 0 = applypriority evict_normal, 1 = discard."""
    i = tl.program_id(0).to(tl.int64) * LINES + tl.arange(0, LINES)
    ptrs = p_ptr + i * 64            # bf16 elements per 128-byte line
    if OP == 0:
        tl.inline_asm_elementwise("applypriority.global.L2::evict_normal [$1], 128; mov.u32 $0, 0;", "=r,l",
                                  [ptrs], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("discard.global.L2 [$1], 128; mov.u32 $0, 0;", "=r,l",
                                  [ptrs], dtype=tl.int32, is_pure=False, pack=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scratch-mb", type=float, default=34.0)
    ap.add_argument("--probe-mb", type=float, default=20.0)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("GIT_COMMIT", "unknown")}, flush=True)
    n = int(args.scratch_mb * 2**20) // 2
    scratch = torch.empty(n, dtype=torch.bfloat16, device=dev)
    probe = torch.randn(int(args.probe_mb * 2**20) // 4, device=dev)
    flush = torch.empty(256 * 2**20 // 4, device=dev)
    nlines = n * 2 // 128            # n bf16 values; the scratch is 128-byte aligned (allocator) and n * 2 % 128 == 0
    block = 4096

    def fill(policy):
        _fill_kernel[(triton.cdiv(n, block),)](scratch, n, 1.0, BLOCK=block, POLICY=policy, num_warps=8)

    def line_op(op):
        _line_op_kernel[(triton.cdiv(nlines, 256),)](scratch, nlines, OP=op, LINES=256, num_warps=8)

    def timed(fn, reps):
        """µs per call over ``reps`` calls queued back to back (the GPU, not the launches, sets the time)."""
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3 / reps

    setups = {
        "none": lambda: fill(""),
        "evict_last": lambda: fill("evict_last"),
        "evict_last+normal": lambda: (fill("evict_last"), line_op(0)),
        "evict_last+discard": lambda: (fill("evict_last"), line_op(1)),
    }
    for f in setups.values():
        f()
    probe.sum()
    torch.cuda.synchronize()
    res = {nm: [] for nm in setups}
    for rnd in range(5):
        for nm, setup in setups.items():
            flush.zero_()
            setup()
            probe.sum()
            torch.cuda.synchronize()
            res[nm].append(timed(lambda: probe.sum(), args.reps))
    base = statistics.median(res["none"])
    for nm, v in res.items():
        m = statistics.median(v)
        print(f"after {nm:20s}: sum of {args.probe_mb:g} MiB {m:.1f} us ({base / m:.2f}x of 'none'; "
              f"{args.probe_mb * 2**20 / m / 1e6:.2f} TB/s)", flush=True)
    fill("evict_last")
    torch.cuda.synchronize()
    print(f"applypriority kernel over {args.scratch_mb:g} MiB: {timed(lambda: line_op(0), 20):.1f} us; "
          f"discard kernel: {timed(lambda: (fill('evict_last'), line_op(1)), 20) - timed(lambda: fill('evict_last'), 20):.1f} us "
          f"(fill+discard minus fill); fill evict_last {timed(lambda: fill('evict_last'), 20):.1f} us, "
          f"fill none {timed(lambda: fill(''), 20):.1f} us", flush=True)


if __name__ == "__main__":
    main()
