#!/usr/bin/env python
"""Benchmark the SeedVR2 DiT (3B, 7B) per step, with random bf16 weights at the real sizes (no download).

For each model x resolution x frame count: time of one DiT forward (median of N after warm-up), peak
VRAM, model FLOPs (the linears plus the attention of the actual windows: 4*S^2*heads*head_dim per
segment of S tokens) and MFU against a bf16 peak measured in the same run with a large torch.matmul.

Latent sizes follow the pipeline: frames padded to 4n+1 -> T = (n-1)/4 + 1 latent frames; pixels padded
to a multiple of 16 -> H/8 x W/8 latent; tokens after the 1x2x2 patch = T * H/16 * W/16. Text: 58 tokens
(the official positive prompt embedding).

VAE: ``--vae`` (default when models/seedvr2/vae imports) adds encode/decode timings of the SeedVR2 VAE
with random bf16 weights for the same inputs. <<< VAE HOOK: see ``bench_vae`` below. >>>

    python scripts/bench_seedvr2.py                 # full table
    python scripts/bench_seedvr2.py --quick         # fewer iterations / cases (device smoke run)
    python scripts/bench_seedvr2.py --json out.json
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import _pack  # registers the checkout as `seedvr2bw`
import torch

from seedvr2bw.models.seedvr2.dit import SEEDVR2_3B, SEEDVR2_7B, NaDiT
from seedvr2bw.models.seedvr2.dit.window import build_joint_layout
from seedvr2bw.optimization.attention import available_backends, resolve_backend
from seedvr2bw.optimization.runtime import knobs

RESOLUTIONS = {"720p": (720, 1280), "1080p": (1080, 1920)}
TXT_LEN = 58


def latent_grid(height: int, width: int, frames: int):
    n = math.ceil((frames - 1) / 4) if frames > 1 else 0
    padded = 4 * n + 1
    h16, w16 = math.ceil(height / 16) * 16, math.ceil(width / 16) * 16
    return padded, (n + 1, h16 // 8, w16 // 8)  # frames after padding, latent (T, H, W)


# --------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------
def dit_flops(cfg, latent, txt_len=TXT_LEN) -> dict:
    T, H, W = latent
    grid = (T, H // 2, W // 2)
    nv, nt = grid[0] * grid[1] * grid[2], txt_len
    d, inner, hid = cfg.dim, cfg.inner_dim, cfg.mlp_hidden
    mlp_mats = 3 if cfg.mlp_type == "swiglu" else 2
    lin = 0.0
    lin += 2 * nv * (cfg.vid_in_channels * 4) * d + 2 * nt * cfg.txt_in_dim * d + 2 * nv * d * cfg.vid_out_channels * 4
    attn = 0.0
    seg_cache = {}
    for i in range(cfg.num_layers):
        last = i == cfg.num_layers - 1
        n_txt_out = 0 if last else nt  # the last block computes no text outputs
        lin += 2 * (nv + nt) * d * 3 * inner  # qkv (text q/k/v are needed by the video even in the last block)
        lin += 2 * (nv + n_txt_out) * inner * d  # out projection
        lin += 2 * (nv + n_txt_out) * d * hid * mlp_mats  # MLP
        m = cfg.window_methods[i]
        if m not in seg_cache:
            lay = build_joint_layout([grid], [nt], m, cfg.window, "cpu")
            seg_cache[m] = lay.plan.q_lens
        attn += sum(4.0 * s * s * inner for s in seg_cache[m])
    return {"linear": lin, "attention": attn, "total": lin + attn, "tokens": nv,
            "segments": {m: len(v) for m, v in seg_cache.items()},
            "max_segment": max(max(v) for v in seg_cache.values())}


# --------------------------------------------------------------------------------------------------
# Timing helpers
# --------------------------------------------------------------------------------------------------
def cuda_time(fn, warmup: int, iters: int):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1000.0)
    return statistics.median(times), times


def bf16_peak_tflops(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    med, _ = cuda_time(lambda: torch.matmul(a, b), warmup=3, iters=iters)
    del a, b
    return 2 * n ** 3 / med / 1e12


def random_dit(cfg, backend: str) -> NaDiT:
    model = NaDiT(cfg, attention_backend=backend, device="cuda", dtype=torch.bfloat16).eval().requires_grad_(False)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_scale", "norm_q.vid.weight", "norm_k.vid.weight", "norm_q.txt.weight",
                              "norm_k.txt.weight", "norm_q.all.weight", "norm_k.all.weight", "vid_out_norm.weight")):
                p.fill_(1.0)
            elif p.dim() == 2:
                p.normal_(0, 1 / math.sqrt(p.shape[1]), generator=g)
            else:
                p.normal_(0, 0.02, generator=g)
    return model


def set_linears(model, kind: str) -> None:
    """The DiT's linears as ``kind``: bf16 (as built), nvfp4 (NVFP4 fidelity path, as the pack picks its kernel),
    nvfp4_dequant (the same weights, the RS kernel off: dequantize + cuBLAS). bf16 must come before the others: the
    quantization is in place."""
    from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear
    from seedvr2bw.optimization.nvfp4.surgery import quantize_model_linears
    if kind != "bf16" and not any(isinstance(m, NVFP4Linear) for m in model.modules()):
        quantize_model_linears(model, path="fidelity")
    os.environ["SEEDVR2BW_RS_KERNEL"] = "off" if kind == "nvfp4_dequant" else "on"
    knobs.reset()


def bench_dit(name, cfg, cases, args, peak):
    rows = []
    model = random_dit(cfg, args.backends[0])
    for kind in args.linears:
        set_linears(model, kind)
        rows += _bench_dit_cases(model, name, cfg, cases, args, peak, kind)
    del model
    torch.cuda.empty_cache()
    return rows


def _bench_dit_cases(model, name, cfg, cases, args, peak, linears):
    rows = []
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 30
    for backend, (res, frames), fz in [(b, c, f) for b in args.backends for c in cases for f in args.fused_modes]:
        os.environ["SEEDVR2BW_FUSED"] = "1" if fz == "on" else "0"
        knobs.reset()
        model.attention_backend = backend
        h, w = RESOLUTIONS[res]
        padded, latent = latent_grid(h, w, frames)
        T, H, W = latent
        fl = dit_flops(cfg, latent)
        vid = torch.randn(T * H * W, cfg.vid_in_channels, device="cuda", dtype=torch.bfloat16)
        txt = torch.randn(TXT_LEN, cfg.txt_in_dim, device="cuda", dtype=torch.bfloat16)
        vs = torch.tensor([[T, H, W]], device="cuda")
        ts = torch.tensor([[TXT_LEN]], device="cuda")
        t = torch.tensor([1000.0], device="cuda")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row = {"model": name, "backend": backend if linears == "bf16" else f"{backend}/{linears}", "linears": linears,
               "fused": fz, "res": res, "frames": frames, "padded_frames": padded, "latent": list(latent),
               "tokens": fl["tokens"], "max_window_tokens": fl["max_segment"], "tflop": fl["total"] / 1e12,
               "attn_flop_share": fl["attention"] / fl["total"], "weights_gib": weights_gib}
        try:
            with torch.no_grad():
                med, times = cuda_time(lambda: model(vid, txt, vs, ts, t), args.warmup, args.iters)
            row.update(step_s=med, times_s=times, peak_vram_gib=torch.cuda.max_memory_allocated() / 2 ** 30,
                       tflops=fl["total"] / med / 1e12, mfu=fl["total"] / med / 1e12 / peak)
        except torch.cuda.OutOfMemoryError as exc:
            row.update(error=f"OOM: {str(exc)[:120]}")
        except Exception as exc:  # noqa: BLE001 - one failing backend/case must not end the run
            row.update(error=f"{type(exc).__name__}: {str(exc)[:160]}")
        rows.append(row)
        print(fmt_row(row), flush=True)
        del vid, txt
    return rows


# --------------------------------------------------------------------------------------------------
# VAE hook (the VAE lives in models/seedvr2/vae, written separately)
# --------------------------------------------------------------------------------------------------
def bench_vae(cases, args):
    """Encode/decode timings of the SeedVR2 VAE with random bf16 weights. Returns [] when not importable."""
    try:
        from seedvr2bw.models.seedvr2.vae import SEEDVR2_VAE, VideoAutoencoder
    except Exception as exc:  # noqa: BLE001
        print(f"# VAE skipped: {type(exc).__name__}: {exc}")
        return []
    vae = VideoAutoencoder(SEEDVR2_VAE).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    rows = []
    for res, frames in cases:
        h, w = RESOLUTIONS[res]
        padded, (T, H, W) = latent_grid(h, w, frames)
        x = torch.rand(1, 3, padded, H * 8, W * 8, device="cuda", dtype=torch.bfloat16) * 2 - 1
        z = torch.randn(1, 16, T, H, W, device="cuda", dtype=torch.bfloat16)
        row = {"model": "vae", "res": res, "frames": frames, "padded_frames": padded, "latent": [T, H, W]}
        for what, fn in (("encode", lambda: vae.encode(x)), ("decode", lambda: vae.decode(z))):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                med, _ = cuda_time(fn, args.vae_warmup, args.vae_iters)
                row[f"{what}_s"] = med
                row[f"{what}_peak_vram_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
            except torch.cuda.OutOfMemoryError as exc:
                row[f"{what}_error"] = f"OOM: {str(exc)[:100]}"
        rows.append(row)
        print("vae   {res:>6} {frames:>3}f  encode {e}  decode {d}".format(
            res=res, frames=frames,
            e=f"{row['encode_s']:.3f}s ({row['encode_peak_vram_gib']:.1f} GiB)" if "encode_s" in row else row.get("encode_error"),
            d=f"{row['decode_s']:.3f}s ({row['decode_peak_vram_gib']:.1f} GiB)" if "decode_s" in row else row.get("decode_error")),
            flush=True)
        del x, z
    return rows


def profile_one(args, cfgs):
    """Top CUDA kernels (self time) of one DiT forward: where the step time goes."""
    name, res, frames = args.profile.split(":")
    cfg = cfgs[name]
    model = random_dit(cfg, args.backends[0])
    _, (T, H, W) = latent_grid(*RESOLUTIONS[res], int(frames))
    vid = torch.randn(T * H * W, cfg.vid_in_channels, device="cuda", dtype=torch.bfloat16)
    txt = torch.randn(TXT_LEN, cfg.txt_in_dim, device="cuda", dtype=torch.bfloat16)
    call = lambda: model(vid, txt, torch.tensor([[T, H, W]], device="cuda"), torch.tensor([[TXT_LEN]], device="cuda"),
                         torch.tensor([1000.0], device="cuda"))
    with torch.no_grad():
        call()
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
    print(f"# profile {args.profile} ({args.backends[0]}): top kernels by self CUDA time")
    try:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))
    except Exception as exc:  # noqa: BLE001 - profiler column names move between versions
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
    del model
    torch.cuda.empty_cache()


def bench_fused_ops(n=21600, d=3072, heads=24, hidden=12288):
    """Each fused op against its torch path (the model's own functions) at the 7B 720p x 21 shape."""
    from seedvr2bw.models.seedvr2.dit import modulation as M
    from seedvr2bw.models.seedvr2.dit.norm import rms_norm
    from seedvr2bw.models.seedvr2.dit.rope import apply_rope, make_rope_table
    from seedvr2bw.optimization import fused

    bf = torch.bfloat16
    dev = "cuda"
    x, o = torch.randn(n, d, device=dev, dtype=bf), torch.randn(n, d, device=dev, dtype=bf)
    e = torch.randn(1, d, 3, device=dev, dtype=bf)
    p = torch.randn(d, device=dev, dtype=bf)
    qkv = torch.randn(n, 3 * d, device=dev, dtype=bf)
    w = torch.ones(128, device=dev, dtype=bf)
    table = make_rope_table(torch.rand(n, 60) * 6, dev)
    perm = torch.randperm(n, device=dev)
    qkv_out = torch.empty(3, n, heads, 128, device=dev, dtype=bf)

    def fused_qkv(variant):
        def run():
            fused.qkv_norm_rope_pack(qkv, heads, 128, w, w, 1e-5, table.cos_pair, table.sin_pair, perm, qkv_out)
        run.qkv_variant = variant
        return run

    lin_w = torch.randn(hidden, d, device=dev, dtype=bf) * d ** -0.5
    lin_b = torch.randn(hidden, device=dev, dtype=bf)
    sa, sb = torch.randn(n, 6912, device=dev, dtype=bf), torch.randn(n, 6912, device=dev, dtype=bf)
    unit = n * d * 2 / 3e12  # one N x D bf16 pass at 3 TB/s

    def torch_qkv():
        t = qkv.view(n, 3, heads, 128)
        for slot in (0, 1):
            apply_rope(rms_norm(t[:, slot], w, 1e-5), table, out=t[:, slot])
        out = torch.empty(n, 3, heads, 128, device=dev, dtype=bf)
        out.index_copy_(0, perm, t)
        return [u.contiguous() for u in out.unbind(1)]

    ops = {
        "norm_modulate": (2, lambda: M.modulate_in(rms_norm(x, None, 1e-5), e, p, p, [n]),
                          lambda: fused.norm_modulate(x, M._vec(e, 1, p), M._vec(e, 0, p), 1e-5, [n])),
        "residual_norm_modulate": (4, lambda: M.modulate_in(rms_norm(M.gated_residual(x, o, e, p, [n]), None, 1e-5), e, p, p, [n]),
                                   lambda: fused.residual_norm_modulate(x, o, M._vec(e, 2, p), M._vec(e, 1, p), M._vec(e, 0, p), 1e-5, [n])),
        "gated_residual": (3, lambda: M.gated_residual(x, o, e, p, [n]), lambda: fused.gated_residual(x, o, M._vec(e, 2, p), [n])),
        "qkv_norm_rope_pack v1": (6, torch_qkv, fused_qkv("v1")),
        "qkv_norm_rope_pack v2": (6, torch_qkv, fused_qkv("v2")),
        "qkv_norm_rope_pack v3": (6, torch_qkv, fused_qkv("v3")),
        "silu_mul(N x 6912)": (3 * 6912 / d, lambda: torch.nn.functional.silu(sa) * sb, lambda: fused.silu_mul(sa, sb)),
        "linear+gelu(N x 4D)": (0, lambda: torch.nn.functional.gelu(torch.nn.functional.linear(x, lin_w, lin_b), approximate="tanh"),
                                lambda: fused.linear_gelu(x, lin_w, lin_b)),
    }
    res = {}
    print(f"# fused ops at N={n}, D={d} (one N x D bf16 pass = {unit * 1e6:.0f} us at 3 TB/s)")
    for name, (passes, ref_fn, fz_fn) in ops.items():
        t_ref, _ = cuda_time(ref_fn, 3, 10)
        with knobs.override(QKV_KERNEL=getattr(fz_fn, "qkv_variant", None)):
            t_fz = cuda_time(fz_fn, 3, 10)[0] if fz_fn is not None else float("nan")
        res[name] = {"torch_us": t_ref * 1e6, "fused_us": t_fz * 1e6, "predicted_us": passes * unit * 1e6}
        print(f"#   {name:>24}: torch {t_ref * 1e6:8.0f} us   fused {t_fz * 1e6:8.0f} us   bytes floor {passes * unit * 1e6:6.0f} us",
              flush=True)
    return res


# --------------------------------------------------------------------------------------------------
def fmt_header():
    return (f"{'model':>5} {'attention/linears':>18} {'fused':>5} {'res':>6} {'frm':>4} {'latent THW':>13} {'tokens':>7} {'maxwin':>6} "
            f"{'TFLOP':>8} {'attn%':>6} {'step s':>8} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8}")


def fmt_row(r):
    if "error" in r:
        return f"{r['model']:>5} {r['backend']:>18} {r.get('fused', '-'):>5} {r['res']:>6} {r['frames']:>4} {str(tuple(r['latent'])):>13} {r['tokens']:>7}  {r['error']}"
    return (f"{r['model']:>5} {r['backend']:>18} {r.get('fused', '-'):>5} {r['res']:>6} {r['frames']:>4} {str(tuple(r['latent'])):>13} {r['tokens']:>7} "
            f"{r['max_window_tokens']:>6} {r['tflop']:>8.1f} {100 * r['attn_flop_share']:>5.1f}% {r['step_s']:>8.3f} "
            f"{r['tflops']:>8.1f} {100 * r['mfu']:>5.1f}% {r['peak_vram_gib']:>8.1f}")



def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="3b,7b", help="comma list of 3b,7b")
    ap.add_argument("--res", default="720p,1080p", help="comma list of 720p,1080p")
    ap.add_argument("--frames", default="1,21", help="comma list of frame counts")
    ap.add_argument("--backend", default="auto",
                    help="comma list of attention backends to time (auto, sdpa, flash_attn, torch_varlen, sage)")
    ap.add_argument("--commit", default=None, help="commit id to record (default: git rev-parse HEAD)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="warmup 1, iters 3, VAE iters 1")
    ap.add_argument("--vae", dest="vae", action="store_true", default=True, help="include VAE timings (default)")
    ap.add_argument("--no-vae", dest="vae", action="store_false")
    ap.add_argument("--vae-res", default=None, help="VAE cases (default: same as --res)")
    ap.add_argument("--vae-iters", type=int, default=3)
    ap.add_argument("--vae-warmup", type=int, default=1)
    ap.add_argument("--profile", default=None, metavar="MODEL:RES:FRAMES",
                    help="also print the top CUDA kernels of one forward, e.g. 3b:720p:21")
    ap.add_argument("--flops-only", action="store_true", help="print the FLOP counts and exit (no GPU needed)")
    ap.add_argument("--json", default=None, help="write the results to this path")
    ap.add_argument("--cases", default=None, metavar="RES:FRAMES,...",
                    help="explicit cases, e.g. 720p:21,1080p:1 (overrides --res/--frames)")
    ap.add_argument("--fused", default="on", choices=["on", "off", "both"],
                    help="Triton fused elementwise kernels (optimization/fused): on, off or both (A/B per case)")
    ap.add_argument("--linears", default="bf16",
                    help="comma list of bf16, nvfp4 (NVFP4 fidelity path), nvfp4_dequant (the same, RS kernel off)")
    ap.add_argument("--fused-ops", action="store_true",
                    help="also time each fused op against its torch path at the 7B 720p x 21 shape")
    args = ap.parse_args()
    args.fused_modes = ["off", "on"] if args.fused == "both" else [args.fused]
    args.linears = [k.strip() for k in args.linears.split(",") if k.strip()]
    if not set(args.linears) <= {"bf16", "nvfp4", "nvfp4_dequant"} or ("bf16" in args.linears and args.linears[0] != "bf16"):
        sys.exit(f"--linears: bf16 (first, if at all), nvfp4, nvfp4_dequant; got {args.linears}")
    if args.quick:
        args.warmup, args.iters, args.vae_iters, args.vae_warmup = 1, 3, 1, 1

    cfgs = {"3b": SEEDVR2_3B, "7b": SEEDVR2_7B}
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    cases = [(r.strip(), int(f)) for r in args.res.split(",") for f in args.frames.split(",")]
    if args.cases:
        cases = [(c.split(":")[0].strip(), int(c.split(":")[1])) for c in args.cases.split(",") if c.strip()]
    if args.flops_only:
        for m in models:
            for res, frames in cases:
                _, latent = latent_grid(*RESOLUTIONS[res], frames)
                fl = dit_flops(cfgs[m], latent)
                print(f"{m} {res} {frames}f latent {latent}: {fl['tokens']} tokens, {fl['total'] / 1e12:.1f} TFLOP "
                      f"(attention {100 * fl['attention'] / fl['total']:.1f}%), windows {fl['segments']}")
        return
    if not torch.cuda.is_available():
        sys.exit("bench_seedvr2.py needs a CUDA device (use --flops-only for the counts)")

    torch.backends.cuda.matmul.allow_tf32 = True
    args.backends = []
    for b in args.backend.split(","):
        try:
            args.backends.append(resolve_backend(b.strip(), torch.device("cuda")))
        except RuntimeError as exc:
            print(f"# skipping attention backend {b.strip()!r}: {exc}")
    args.backends = list(dict.fromkeys(args.backends)) or ["sdpa"]
    backend = ",".join(args.backends)
    peak = bf16_peak_tflops()
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": args.commit or _pack.git_commit(),
            "attention_backend": backend, "available_backends": available_backends("cuda"),
            "bf16_matmul_peak_tflops": peak, "warmup": args.warmup, "iters": args.iters,
            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    print(f"# {info['device']} | torch {info['torch']} | commit {info['commit']} | attention {backend} "
          f"(available {info['available_backends']}) | measured bf16 matmul peak {peak:.0f} TFLOP/s")
    print(fmt_header(), flush=True)
    from seedvr2bw.optimization import fused
    info["fused_selftest"] = fused.selftest(torch.device("cuda")) if fused.triton_available() else (False, "no triton")
    print(f"# fused kernels self-test: {info['fused_selftest']}")
    if args.fused_ops:
        info["fused_ops"] = bench_fused_ops()
    rows = []
    for m in models:
        rows += bench_dit(m, cfgs[m], cases, args, peak)
    vae_rows = []
    if args.vae:
        vres = args.vae_res.split(",") if args.vae_res else [r for r, _ in cases]
        vcases = [c for c in cases if c[0] in vres]
        vae_rows = bench_vae(list(dict.fromkeys(vcases)), args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "dit": rows, "vae": vae_rows}, f, indent=1)
        print(f"# wrote {args.json}")
    if args.profile:
        profile_one(args, cfgs)


if __name__ == "__main__":
    main()
