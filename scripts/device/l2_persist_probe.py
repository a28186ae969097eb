"""Device probe: can the fidelity path's bf16 weight stay in L2 between the dequantize and the GEMM?

Session 9 put dequantize + cuBLAS at ~0.94x bf16 at M = 4096, the ceiling of a path whose 2 B/weight of bf16
output go to HBM. Variants (all dequantize into one fixed scratch buffer unless said otherwise):
* ``bf16``: F.linear on the bf16 weight (the baseline); ``layer``: the shipped NVFP4Linear fidelity path;
  ``fixed``: the shipped dequantize kernel, no hint (the control);
* ``persist``: a CUDA access-policy window on the stream over the scratch (hitProp persisting), persisting L2
  set-aside at its maximum, hitRatio = set-aside / window (CUDA driver API via ctypes);
* ``evict_last`` / ``hint_none``: the shipped kernel at tile (16, 128, 4 warps) with / without its L2_KEEP
  (evict_last) stores; ``cfgRxCwW`` / ``cfgLRxCwW``: other tiles without / with them (``--configs``). (Session
  14's runs used a copy of the kernel that also put evict_first on its loads: ``hint_store``, stores only,
  timed the same.)
* ``nslabMBxS``: S slabs of weight rows of <= MB MiB each, dequantized (evict_last) and multiplied into column
  slices of the output (cuBLASLt with ldd = N and the bias epilogue: ``_cublaslt.py``); ``ovslab``: the same with
  slab i+1 dequantized on a side stream during slab i's GEMM; ``kslab``: slabs of columns (K), partial sums
  accumulated in the bf16 output (not bit-equal).
Timing: ``--inner`` calls per span (eager, or one CUDA-graph replay with ``--graph``), ``--rounds`` rounds in
rotating order; ratio = median over rounds of bf16 / variant in the same round. Every variant's output is checked
against ``fixed``'s (bit-equal, or the relative difference is printed), with the scratch zeroed first.
``--breakdown`` times dequantize and GEMM apart; ``--deq-only`` times dequantizes back to back (host-bound for
these sizes: not a kernel figure). Session 14's findings are in docs/BENCHMARKS.md.
    python scripts/device/l2_persist_probe.py [--m 4096] [--graph] [--variants layer,evict_last] [--json out.json]
"""
import argparse
import ctypes
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _pack  # noqa: E402,F401
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from seedvr2bw.optimization.nvfp4 import format as fmt  # noqa: E402
from seedvr2bw.optimization.nvfp4 import kernels as K  # noqa: E402
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import _cublaslt as cublaslt  # noqa: E402  (probe-only ctypes binding, from commit cf7a84a)
from _graph_timing import capture  # noqa: E402

SHAPES = [(2560, 6912), (6912, 2560), (3072, 12288), (12288, 3072), (3072, 9216), (3072, 3072)]

# --- CUDA driver API: persisting L2 set-aside and the stream's access-policy window -----------------------------
_cu = ctypes.CDLL("libcuda.so.1")
CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108
CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE = 109
CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
CU_ACCESS_PROPERTY_STREAMING, CU_ACCESS_PROPERTY_PERSISTING = 1, 2


class _Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class _AttrValue(ctypes.Union):
    _fields_ = [("window", _Window), ("pad", ctypes.c_char * 64)]


def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def device_attr(attr):
    v = ctypes.c_int()
    _check(_cu.cuDeviceGetAttribute(ctypes.byref(v), attr, torch.cuda.current_device()), "cuDeviceGetAttribute")
    return v.value


def set_persisting_limit(nbytes):
    _check(_cu.cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(nbytes)), "cuCtxSetLimit")
    got = ctypes.c_size_t()
    _check(_cu.cuCtxGetLimit(ctypes.byref(got), CU_LIMIT_PERSISTING_L2_CACHE_SIZE), "cuCtxGetLimit")
    return got.value


def set_window(stream, ptr, nbytes, hit_ratio):
    v = _AttrValue()
    v.window.base_ptr = ptr
    v.window.num_bytes = nbytes
    v.window.hitRatio = hit_ratio
    v.window.hitProp = CU_ACCESS_PROPERTY_PERSISTING
    v.window.missProp = CU_ACCESS_PROPERTY_STREAMING
    _check(_cu.cuStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream), CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW,
                                    ctypes.byref(v)), "cuStreamSetAttribute")


def clear_window(stream):
    v = _AttrValue()
    _check(_cu.cuStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream), CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW,
                                    ctypes.byref(v)), "cuStreamSetAttribute(clear)")
    _check(_cu.cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")


def time_rounds(fns, inner, rounds, graph=False):
    """ms per call of each variant, per round (rotating order). graph: CUDA-graph replays of ``inner`` calls
    (the persisting window is a stream attribute, so those variants are timed eagerly)."""
    names = list(fns)
    per = {nm: [] for nm in names}
    graphs = {}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for nm in order:
            setup, fn, teardown = fns[nm]
            setup()
            use_graph = graph and "persist" not in nm
            if use_graph and nm not in graphs:
                graphs[nm] = capture(fn, inner)
            for _ in range(3 if not use_graph else 1):
                graphs[nm].replay() if use_graph else fn()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            if use_graph:
                graphs[nm].replay()
            else:
                for _ in range(inner):
                    fn()
            b.record()
            b.synchronize()
            per[nm].append(a.elapsed_time(b) / inner)
            teardown()
    return per


def split_times(deq, gemm, inner):
    """Median µs of the dequantize and of the GEMM when they run chained (dequant, GEMM, dequant, ...)."""
    for _ in range(3):
        gemm(deq() if deq else None)
    torch.cuda.synchronize()
    evs = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(inner)]
    for e0, e1, e2 in evs:
        e0.record()
        w = deq() if deq else None
        e1.record()
        gemm(w)
        e2.record()
    torch.cuda.synchronize()
    d = sorted(e0.elapsed_time(e1) * 1e3 for e0, e1, _ in evs)
    g = sorted(e1.elapsed_time(e2) * 1e3 for _, e1, e2 in evs)
    return d[inner // 2], g[inner // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--setaside-mb", type=float, default=None, help="persisting set-aside (default: the maximum)")
    ap.add_argument("--slab-mb", type=lambda v: [float(t) for t in v.split(",")], default=[12.0, 24.0])
    ap.add_argument("--variants", default=None, help="comma list: time only these (bf16 always)")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (else eager launches)")
    ap.add_argument("--configs", default="", help="dequant tiles to sweep as R:C:W,... (variants cfgRxCwW, no hints)")
    ap.add_argument("--reverse", action="store_true", help="time the variants in reverse order (bf16 first)")
    ap.add_argument("--raw", action="store_true", help="print every round's time")
    ap.add_argument("--deq-only", action="store_true", help="time --configs dequantizes back to back (scratch in L2)")
    ap.add_argument("--breakdown", action="store_true", help="also time dequant and GEMM apart, chained")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    max_persist = device_attr(CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE)
    max_window = device_attr(CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE)
    want = int(args.setaside_mb * 2**20) if args.setaside_mb else max_persist
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("GIT_COMMIT", "unknown"), "l2_bytes": torch.cuda.get_device_properties(dev).L2_cache_size,
            "max_persisting_l2": max_persist, "max_window": max_window, "m": args.m, "inner": args.inner,
            "rounds": args.rounds}
    print(info, flush=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    biggest = max(k * n for k, n in shapes)
    scratch = torch.empty(biggest, dtype=torch.bfloat16, device=dev)
    scratch2 = torch.empty(biggest, dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.current_stream()
    gen = torch.Generator(device="cpu").manual_seed(5)
    results = []
    for k, n in shapes:
        w = (torch.randn(n, k, generator=gen) * 0.02).to(dev)
        t = fmt.quantize_nvfp4(w, return_tensor=True)
        bias = (torch.randn(n, generator=gen) * 0.1).to(dev, torch.bfloat16)
        lin = NVFP4Linear.from_nvfp4(t, bias=bias, path="fidelity", dtype=torch.bfloat16)
        lin.fidelity_kernel = "dequant"
        x = (torch.randn(args.m, k, generator=gen)).to(dev, torch.bfloat16)
        wb = lin.dequantize_weight(torch.bfloat16)
        buf = scratch[: n * k].view(n, k)
        g = lin.weight_scale_2.float().reshape(1)
        nbytes = n * k * 2

        def deq_fixed():
            return K.dequantize_nvfp4_triton(lin.weight, lin.weight_scale, g, (n, k), dtype=torch.bfloat16, out=buf)

        lut = K.byte_lut(dev)

        def hint_launch(packed, scales, out, rows, c0, cols, store="evict_last", cfg=(16, 128, 4)):
            """The shipped dequantize kernel (``kernels._dequant_kernel``, not autotuned) at tile ``cfg``;
            store="evict_last": its L2_KEEP stores."""
            hc = cols // 2
            r_, c_, w_ = cfg
            K.dequant_kernel.fn[(triton.cdiv(rows, r_), triton.cdiv(hc, c_))](
                packed, scales, lut, g, out, packed.shape[0], packed.shape[1], rows, cols, scales.shape[1] // 4,
                c0 // 2, hc, BLOCK_R=r_, BLOCK_C=c_, ASM_DECODE=True, L2_KEEP=store == "evict_last", num_warps=w_)
            return out

        def deq_hint():
            return hint_launch(lin.weight, lin.weight_scale, buf, n, 0, k)

        def deq_no_hint():
            return hint_launch(lin.weight, lin.weight_scale, buf, n, 0, k, store="")

        def n_slabs_overlap(mb):
            """Two scratch slabs; slab i+1 is dequantized on a high-priority side stream while slab i's GEMM runs."""
            rows = max(128, int(mb * 2**20) // (2 * k) // 128 * 128)
            bounds = [(n0, min(n0 + rows, n)) for n0 in range(0, n, rows)]
            plans = [(cublaslt.LtLinear(args.m, n1 - n0, k, k, k, n, torch.bfloat16, dev, has_bias=True),
                      lin.weight[n0:n1], lin.weight_scale[n0:], n0, n1) for n0, n1 in bounds]
            bufs = [scratch[: rows * k], scratch2[: rows * k]]
            out = torch.empty((args.m, n), dtype=torch.bfloat16, device=dev)
            lo, hi = torch.cuda.Stream.priority_range()
            side = torch.cuda.Stream(device=dev, priority=hi)

            def run():
                main_s = torch.cuda.current_stream()
                side.wait_stream(main_s)
                done = [None, None]
                for i, (lt, packed, scales, n0, n1) in enumerate(plans):
                    with torch.cuda.stream(side):
                        if done[i % 2] is not None:
                            side.wait_event(done[i % 2])        # GEMM i-2 has read this buffer
                        hint_launch(packed, scales, bufs[i % 2][: (n1 - n0) * k].view(n1 - n0, k), n1 - n0, 0, k)
                        ready = torch.cuda.Event()
                        ready.record(side)
                    main_s.wait_event(ready)
                    lt(x.data_ptr(), bufs[i % 2].data_ptr(), out.data_ptr() + n0 * 2, main_s.cuda_stream,
                       bias.data_ptr() + n0 * 2)
                    d = torch.cuda.Event()
                    d.record(main_s)
                    done[i % 2] = d
                return out
            return run, len(bounds)

        def n_slabs(mb):
            rows = max(128, int(mb * 2**20) // (2 * k) // 128 * 128)
            bounds = [(n0, min(n0 + rows, n)) for n0 in range(0, n, rows)]
            plans = []
            for n0, n1 in bounds:
                lt = cublaslt.LtLinear(args.m, n1 - n0, k, k, k, n, torch.bfloat16, dev, has_bias=True)
                packed = lin.weight[n0:n1]
                scales = lin.weight_scale[n0:]
                plans.append((lt, packed, scales, n0, n1))
            out = torch.empty((args.m, n), dtype=torch.bfloat16, device=dev)

            def run():
                st = torch.cuda.current_stream().cuda_stream
                for lt, packed, scales, n0, n1 in plans:
                    w = hint_launch(packed, scales, scratch[: (n1 - n0) * k].view(n1 - n0, k), n1 - n0, 0, k)
                    lt(x.data_ptr(), w.data_ptr(), out.data_ptr() + n0 * 2, st, bias.data_ptr() + n0 * 2)
                return out
            return run, len(bounds)

        def k_slabs(mb):
            cols = max(64, int(mb * 2**20) // (2 * n) // 64 * 64)
            bounds = [(c0, min(c0 + cols, k)) for c0 in range(0, k, cols)]

            def run():
                out = None
                for c0, c1 in bounds:
                    w = hint_launch(lin.weight, lin.weight_scale, scratch[: n * (c1 - c0)].view(n, c1 - c0), n, c0,
                                    c1 - c0)
                    if out is None:
                        out = F.linear(x[:, c0:c1], w, bias)
                    else:
                        out.addmm_(x[:, c0:c1], w.t())
                return out
            return run, len(bounds)

        hit = min(1.0, want / nbytes)
        nothing = lambda: None  # noqa: E731
        fns = {
            "bf16": (nothing, lambda: F.linear(x, wb, bias), nothing),
            "layer": (nothing, lambda: lin(x), nothing),
            "fixed": (nothing, lambda: F.linear(x, deq_fixed(), bias), nothing),
            "persist": (lambda: (set_persisting_limit(want), set_window(stream, buf.data_ptr(), min(nbytes, max_window), hit)),
                        lambda: F.linear(x, deq_fixed(), bias), lambda: clear_window(stream)),
            "evict_last": (nothing, lambda: F.linear(x, deq_hint(), bias), nothing),
            "hint_none": (nothing, lambda: F.linear(x, deq_no_hint(), bias), nothing),
            "persist_hint": (lambda: (set_persisting_limit(want), set_window(stream, buf.data_ptr(), min(nbytes, max_window), hit)),
                             lambda: F.linear(x, deq_hint(), bias), lambda: clear_window(stream)),
        }
        for spec in filter(None, args.configs.split(",")):
            cfg = tuple(int(v) for v in spec.split(":"))
            fns[f"cfg{cfg[0]}x{cfg[1]}w{cfg[2]}"] = (
                nothing, (lambda cfg=cfg: F.linear(x, hint_launch(lin.weight, lin.weight_scale, buf, n, 0, k, store="",
                                                                  cfg=cfg), bias)), nothing)
            fns[f"cfgL{cfg[0]}x{cfg[1]}w{cfg[2]}"] = (
                nothing, (lambda cfg=cfg: F.linear(x, hint_launch(lin.weight, lin.weight_scale, buf, n, 0, k,
                                                                  cfg=cfg), bias)), nothing)
        for mb in args.slab_mb:
            run, count = n_slabs(mb)
            if count > 1:
                fns[f"nslab{mb:g}x{count}"] = (nothing, run, nothing)
            run, count = n_slabs_overlap(mb)
            if count > 1:
                fns[f"ovslab{mb:g}x{count}"] = (nothing, run, nothing)
            run, count = k_slabs(mb)
            if count > 1:
                fns[f"kslab{mb:g}x{count}"] = (nothing, run, nothing)
        ref = F.linear(x, deq_fixed(), bias).clone()
        try:
            deq_hint()
        except Exception as exc:  # noqa: BLE001 - this Triton has no store eviction hint: drop those variants
            print(f"evict_last variants dropped: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            fns = {nm: v for nm, v in fns.items() if "hint" not in nm and nm != "evict_last"}
        exact = {}
        for nm, (setup, fn, teardown) in fns.items():
            setup()
            scratch.zero_()
            scratch2.zero_()
            y = fn()
            torch.cuda.synchronize()
            exact[nm] = bool(torch.equal(y, ref)) or f"rel {((y.float() - ref.float()).norm() / ref.float().norm()).item():.2e}"
            teardown()
        if args.deq_only:
            line = []
            for spec in filter(None, args.configs.split(",")) or ["16:128:4"]:
                cfg = tuple(int(v) for v in spec.split(":"))
                for store in ("", "evict_last"):
                    f = (lambda cfg=cfg, store=store: hint_launch(lin.weight, lin.weight_scale, buf, n, 0, k,
                                                                  store=store, cfg=cfg))
                    for _ in range(5):
                        f()
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(50):
                        f()
                    b.record()
                    b.synchronize()
                    us = a.elapsed_time(b) / 50 * 1e3
                    moved = nbytes + lin.weight.numel() + lin.weight_scale.numel()
                    line.append(f"{spec}{'L' if store else ''} {us:.1f}us {moved / us / 1e6:.2f}TB/s")
            print(f"K={k} N={n} dequant back to back: " + " | ".join(line), flush=True)
        if args.breakdown:
            bd = {}
            for nm, deq in (("bf16", None), ("fixed", deq_fixed), ("hint_none", deq_no_hint),
                            ("evict_last", deq_hint)):
                bd[nm] = split_times(deq, (lambda w: F.linear(x, w if w is not None else wb, bias)), args.inner)
            print(f"K={k} N={n} breakdown (dequant us, GEMM us): " + " | ".join(
                f"{nm} {d:.1f} + {g:.1f}" for nm, (d, g) in bd.items()), flush=True)
        if args.variants:
            keep = set(args.variants.split(",")) | {"bf16"}
            fns = {nm: v for nm, v in fns.items() if nm in keep or any(nm.startswith(p) for p in keep)}
        if args.reverse:
            fns = dict([("bf16", fns["bf16"])] + [(nm, v) for nm, v in reversed(fns.items()) if nm != "bf16"])
        per = time_rounds(fns, args.inner, args.rounds, graph=args.graph)
        if args.raw:
            for nm, v in per.items():
                print(f"  raw {nm}: " + " ".join(f"{t:.4f}" for t in v), flush=True)
        med = {nm: statistics.median(v) for nm, v in per.items()}
        ratio = {nm: statistics.median([per["bf16"][i] / per[nm][i] for i in range(args.rounds)]) for nm in per}
        shipped = getattr(K.dequant_kernel, "best_config", None)
        print(f"shipped dequant config: {shipped}", flush=True)
        row = {"shipped_config": str(shipped), "k": k, "n": n, "weight_mb": nbytes / 2**20, "hit_ratio": hit, "ms": med, "x_bf16": ratio,
               "exact_vs_fixed": exact}
        results.append(row)
        print(f"K={k} N={n} ({nbytes / 2**20:.1f} MiB bf16, hit {hit:.2f}): " + " | ".join(
            f"{nm} {med[nm]:.4f} ms {ratio[nm]:.3f}x{'' if exact[nm] is True else ' (' + exact[nm] + ')'}" for nm in per), flush=True)
        del w, lin, t, x, wb, ref
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"info": info, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
