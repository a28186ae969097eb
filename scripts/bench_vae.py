"""Benchmark the SeedVR2 video VAE at real dimensions with random weights.

Encode/decode time (median of N after warm-up) and peak VRAM at 720p and 1080p for 1 and 21 frames, one pass with
the official temporal slicing and memory limits, and spatially tiled. Random weights: the speed and memory of
the VAE do not depend on the values. Each row also gives the call's convolution FLOPs (torch's FlopCounterMode on a
meta-device copy) and their rate against the dense matmul peak measured at the start of the same run, so the
distance to the convolution floor is read off each row.

  python scripts/bench_vae.py                      # 720p + 1080p, 1 and 21 frames, untiled + tiled
  python scripts/bench_vae.py --quick --json out.json
  python scripts/bench_vae.py --resolutions 1280x720 --frames 5 --ops decode --repeats 5

Other scripts may import `bench_vae(device, dtype, resolutions, frames, ...) -> list[dict]`.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import _pack  # registers the pack as `seedvr2bw`
import torch
from torch.utils.flop_counter import FlopCounterMode

from seedvr2bw.models.seedvr2.memory import SeedVR2MemoryError, plan_vae
from seedvr2bw.models.seedvr2.pipeline import RunPlan, VAETiling
from seedvr2bw.models.seedvr2.vae import SEEDVR2_VAE, VAEConfig, VideoAutoencoder
from seedvr2bw.models.seedvr2.vae.tiling import estimate_decode_bytes, estimate_encode_bytes
from seedvr2bw.optimization.runtime import selftests
from seedvr2bw.optimization.runtime.policy import get_policy, torch_settings

GIB = 1024 ** 3


def make_random_vae(device="cuda", dtype=torch.bfloat16, config: VAEConfig = SEEDVR2_VAE, seed: int = 0):
    """Real-dimension VAE with random weights (conv/linear N(0, 1/fan_in), norms 1, biases 0), built directly on
    the device."""
    with torch.device("meta"):
        vae = VideoAutoencoder(config)
    vae.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0 if ("norm" in name and name.endswith("weight")) else 0.0)
            else:
                fan_in = p[0].numel()
                p.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=g)
    return vae.to(dtype).eval().requires_grad_(False)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def count_flops(config: VAEConfig, dtype, op: str, shape, tiled: bool, tile: int, overlap: int) -> dict:
    """FLOPs of one call as ``bench_vae`` times it, counted by torch's ``FlopCounterMode`` on a meta-device copy of
    the VAE (shapes only): ``{"conv": convolutions, "total": every counted op}``."""
    with torch.device("meta"):
        vae = VideoAutoencoder(config).to(dtype).eval().requires_grad_(False)
        x = torch.empty(shape, dtype=dtype)
    fn = {("encode", False): lambda: vae.encode(x), ("encode", True): lambda: vae.encode_tiled(x, tile, overlap),
          ("decode", False): lambda: vae.decode(x), ("decode", True): lambda: vae.decode_tiled(x, tile, overlap)}
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        fn[(op, tiled)]()
    counts = fc.get_flop_counts().get("Global", {})
    return {"conv": sum(v for k, v in counts.items() if "convolution" in str(k)), "total": fc.get_total_flops()}


def matmul_peak_tflops(device, dtype=torch.bfloat16, n: int = 8192, repeats: int = 20) -> float | None:
    """The dense matmul rate this GPU sustains in ``dtype`` now (n x n x n, median of ``repeats``): the yardstick the
    convolutions' rate is read against, measured in the same run (clocks and power caps move it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n ** 3 / statistics.median(times) / 1e12



def profile_call(run, device, path, title: str, rows: int = 45) -> None:
    """One call of ``run`` under torch.profiler; the ops and kernels with the most self device time go to ``path``."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with profile(activities=acts) as prof:
        out = run()
        _sync(device)
        del out
    key = "self_device_time_total" if torch.device(device).type == "cuda" else "self_cpu_time_total"
    with open(path, "a") as f:
        f.write(f"## {title}\n{prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=90)}\n")


def _pair(v) -> tuple:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def planned_tiles(vae: VideoAutoencoder, width: int, height: int, frames: int, budget_gib: float):
    """The memory plan's VAE choice (``memory.plan_vae``) for a run on width x height frames, ``frames`` a chunk, that
    may use ``budget_gib`` of VRAM: ((encode tile, overlap), (decode tile, overlap), conv band bytes or None)."""
    run = RunPlan(frames=frames, target=(height, width), model=(height, width), chunks=[(0, frames)],
                  weights=[torch.ones(frames)], tiling=VAETiling())
    vae_bytes = sum(p.numel() * p.element_size() for p in vae.parameters())
    vp = plan_vae(run, int(budget_gib * GIB), vae_bytes, vae.dtype, vae.config,
                  whole_convs=vae.layout() == torch.channels_last_3d)
    return vp.encode_tiles, vp.decode_tiles, vp.conv_bytes


def bench_vae(device="cuda", dtype=torch.bfloat16, resolutions=((1280, 720), (1920, 1080)), frames=(1, 21),
              ops=("encode", "decode"), tiled=(False, True), encode_tile=512, encode_overlap=64,
              decode_tile=64, decode_overlap=8, warmup=1, repeats=3, heavy_repeats=None, vae=None,
              time_budget_s=None, log=print, profile_path=None, cudnn_benchmark=None) -> list:
    """Time encode/decode. Returns one dict per (op, resolution, frames, tiled). Tiles: an int or an (h, w) pair.

    frames are pixel frames (4n + 1); decode is timed on the latent of that clip ((T-1)/4 + 1 latent frames) and
    produces T frames. heavy_repeats (default: repeats) applies to clips of more than 1 frame. Configurations left
    when time_budget_s is spent are returned with "skipped": True. ``profile_path``: one more call of each
    configuration under torch.profiler, its ops and kernels by device time appended to that file. The calls run
    under the hardware policy's TF32 / cuDNN settings, as the pipeline runs them (``cudnn_benchmark`` True/False
    overrides its autotuning choice).
    """
    device = torch.device(device)
    vae = vae or make_random_vae(device, dtype)
    cuda = device.type == "cuda"
    s, tf = vae.spatial_factor, vae.temporal_factor
    info = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__,
                commit=_pack.git_commit(), dtype=str(dtype).replace("torch.", ""))
    elem = torch.empty((), dtype=dtype).element_size()
    peak = matmul_peak_tflops(device, dtype) if dtype in (torch.bfloat16, torch.float16) else None
    if peak is not None:
        info["matmul_peak_tflops"] = peak
        log(f"{info['dtype']} matmul peak this run: {peak:.0f} TFLOP/s")
    configs = [(op, w, h, t, til) for t in frames for (w, h) in resolutions for op in ops for til in tiled]
    configs.sort(key=lambda c: c[1] * c[2] * c[3])          # cheapest first, so a time budget keeps the most rows
    policy = get_policy(device, None if cudnn_benchmark is None else {"cudnn_benchmark": cudnn_benchmark})
    info["cudnn_benchmark"] = policy.cudnn_benchmark
    rows, start = [], time.perf_counter()
    with torch_settings(policy):
        for op, w, h, t, til in configs:
            row = dict(info, op=op, width=w, height=h, frames=t, tiled=til)
            if (t - 1) % tf:
                raise ValueError(f"frames must be {tf}n + 1, got {t}")
            if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
                rows.append(dict(row, skipped=True))
                log(f"skip {op} {w}x{h}x{t} tiled={til} (time budget)")
                continue
            lt, lh, lw = (t - 1) // tf + 1, h // s, w // s
            # the memory model the plan uses for this call: whole convs (NDHWC, no band limit), bands, or official
            conv_est = vae.conv_bytes() if vae.layout_on(device) == torch.channels_last_3d else None
            g = torch.Generator(device=device).manual_seed(1)
            et, dt = _pair(encode_tile), _pair(decode_tile)
            if op == "encode":
                inp = torch.rand(1, 3, t, lh * s, lw * s, generator=g, device=device, dtype=dtype) * 2 - 1
                row.update(tile=list(et) if til else None, overlap=encode_overlap if til else None,
                           latent_shape=[1, vae.config.latent_channels, lt, lh, lw],
                           est_working_set_gib=estimate_encode_bytes(
                               (min(et[0], lh * s), min(et[1], lw * s)) if til else (lh * s, lw * s),
                               vae.config, elem, conv_bytes=conv_est) / GIB)
                run = (lambda: vae.encode_tiled(inp, encode_tile, encode_overlap)) if til else (lambda: vae.encode(inp))
            else:
                inp = torch.randn(1, vae.config.latent_channels, lt, lh, lw, generator=g, device=device, dtype=dtype)
                row.update(tile=list(dt) if til else None, overlap=decode_overlap if til else None,
                           latent_shape=list(inp.shape),
                           est_working_set_gib=estimate_decode_bytes(
                               (min(dt[0], lh), min(dt[1], lw)) if til else (lh, lw), vae.config, elem,
                               conv_bytes=conv_est) / GIB)
                run = (lambda: vae.decode_tiled(inp, decode_tile, decode_overlap)) if til else (lambda: vae.decode(inp))
            tile, overlap = (encode_tile, encode_overlap) if op == "encode" else (decode_tile, decode_overlap)
            flops = count_flops(vae.config, dtype, op, tuple(inp.shape), til, tile, overlap)
            row.update(conv_tflop=flops["conv"] / 1e12, tflop=flops["total"] / 1e12)
            if peak is not None:
                row["conv_floor_s"] = flops["conv"] / 1e12 / peak
            n = repeats if t == 1 or heavy_repeats is None else heavy_repeats
            try:
                for _ in range(warmup):
                    out = run()
                    del out
                _sync(device)
                if cuda:
                    torch.cuda.empty_cache()
                    base = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                times = []
                for _ in range(n):
                    _sync(device)
                    t0 = time.perf_counter()
                    out = run()
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                    del out
                row.update(times_s=times, median_s=statistics.median(times))
                row["conv_tflops"] = row["conv_tflop"] / row["median_s"]
                if peak is not None:
                    row["conv_share_of_peak"] = row["conv_tflops"] / peak
                if cuda:
                    top = torch.cuda.max_memory_allocated(device)   # not `peak`: that is the matmul rate of every row
                    row.update(peak_vram_gib=top / GIB, peak_above_inputs_gib=(top - base) / GIB)
                if profile_path:
                    profile_call(run, device, profile_path, _fmt(row))
            except torch.cuda.OutOfMemoryError as e:  # report and go on
                row.update(error=f"OOM: {str(e).splitlines()[0]}")
            finally:
                del inp
                if cuda:
                    torch.cuda.empty_cache()
            log(_fmt(row))
            rows.append(row)
    return rows


def _fmt(r) -> str:
    head = f"{r['op']:6s} {r['width']}x{r['height']} T={r['frames']:<3d} {'tiled ' if r['tiled'] else 'single'}"
    if "error" in r:
        return f"{head}  {r['error']}"
    peak = f"  peak {r['peak_vram_gib']:.2f} GiB (+{r['peak_above_inputs_gib']:.2f})" if "peak_vram_gib" in r else ""
    rate = f"  conv {r['conv_tflop']:.3g} TFLOP at {r['conv_tflops']:.3g} TFLOP/s" if "conv_tflops" in r else ""
    if "conv_share_of_peak" in r:
        rate += f" ({100 * r['conv_share_of_peak']:.0f} % of the matmul peak; floor {r['conv_floor_s'] * 1000:.0f} ms)"
    return f"{head}  median {r['median_s'] * 1000:9.1f} ms{peak}  est {r['est_working_set_gib']:.2f} GiB{rate}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--resolutions", default="1280x720,1920x1080", help="WxH list")
    ap.add_argument("--frames", default="1,21", help="pixel frames, each 4n+1")
    ap.add_argument("--ops", default="encode,decode")
    ap.add_argument("--tiled", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--encode-tile", type=int, default=512)
    ap.add_argument("--encode-overlap", type=int, default=64)
    ap.add_argument("--decode-tile", type=int, default=64)
    ap.add_argument("--decode-overlap", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--heavy-repeats", type=int, default=None, help="repeats for clips of more than one frame")
    ap.add_argument("--budget-s", type=float, default=None, help="skip configurations once this much time is spent")
    ap.add_argument("--cudnn-benchmark", default="policy", choices=["policy", "on", "off"],
                    help="cuDNN autotuning in the timed calls (default: the hardware policy's, as the pipeline)")
    ap.add_argument("--profile", default=None, help="append a torch.profiler table of one more call per row here")
    ap.add_argument("--layouts", default="default",
                    help="activation layouts to time, one after the other on the same model: default (the "
                         "hardware policy's vae_channels_last), ncdhw, ndhwc; e.g. ncdhw,ndhwc")
    ap.add_argument("--conv-limits", default="official",
                    help="the VAE's conv memory limit per pass, in GiB, or official (0.5 GiB: convs over it run in "
                         "bands) or none (no bands); e.g. official,none times both and records each one's peak")
    ap.add_argument("--budgets", default="",
                    help="GiB list: also time each clip with the tiles and conv bands the memory plan picks for a run "
                         "that may use that much VRAM (the DiT off the GPU, memory.plan_vae), e.g. 8,12; the GPU is "
                         "not filled, only the choice is the budget's")
    ap.add_argument("--quick", action="store_true", help="repeats 3 (1 frame) / 2 (longer clips), budget 150 s")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    if a.quick:
        a.repeats, a.heavy_repeats, a.budget_s = 3, 2, a.budget_s or 150.0
    res = [tuple(int(v) for v in r.lower().split("x")) for r in a.resolutions.split(",")]
    frames = [int(f) for f in a.frames.split(",")]
    tiled = {"both": (False, True), "yes": (True,), "no": (False,)}[a.tiled]
    print(f"device {a.device}, torch {torch.__version__}, dtype {a.dtype}, commit {_pack.git_commit()}", flush=True)
    dtype = getattr(torch, a.dtype)
    vae = make_random_vae(a.device, dtype)
    rows = []
    for limit in a.conv_limits.split(","):
        conv = vae.config.conv_max_mem if limit == "official" else None if limit == "none" else float(limit)
        vae.set_memory_limit(conv, vae.config.norm_max_mem)
        for layout in a.layouts.split(","):
            vae.channels_last = {"default": None, "ncdhw": False, "ndhwc": True}[layout]
            print(f"layout {layout}: {vae.layout()}, conv memory limit {limit}", flush=True)
            got = bench_vae(a.device, dtype, res, frames, tuple(a.ops.split(",")), tiled, a.encode_tile,
                            a.encode_overlap, a.decode_tile, a.decode_overlap, a.warmup, a.repeats, a.heavy_repeats,
                            vae=vae, time_budget_s=a.budget_s, log=lambda m: print(m, flush=True),
                            profile_path=a.profile,
                            cudnn_benchmark={"policy": None, "on": True, "off": False}[a.cudnn_benchmark])
            rows += [dict(r, layout=str(vae.layout()).replace("torch.", ""), conv_limit=limit) for r in got]
    for feature in ("fused", "gemm_attention"):      # the kernels the timed calls ran, as their self-tests chose
        st = selftests.status(feature, a.device)
        if st is not None:
            print(f"self-test {feature}: {'on' if st[0] else 'off'} ({st[1]})", flush=True)
    for budget in [float(b) for b in a.budgets.split(",") if b]:
        vae.channels_last = None
        for (w, h) in res:
            for t in frames:
                try:
                    enc, dec, conv = planned_tiles(vae, w, h, t, budget)
                except SeedVR2MemoryError as exc:
                    print(f"{budget:g} GiB, {w}x{h} x {t}: {exc}", flush=True)
                    rows.append(dict(budget_gib=budget, width=w, height=h, frames=t, error=str(exc)))
                    continue
                vae.set_memory_limit(None if conv is None else conv / GIB, vae.config.norm_max_mem)
                print(f"plan at {budget:g} GiB, {w}x{h} x {t}: encode tiles {enc}, decode tiles {dec}, conv bands "
                      f"{'none' if conv is None else f'{conv / 2**20:.0f} MiB'}", flush=True)
                for op, (tile, overlap) in (("encode", enc), ("decode", dec)):
                    if op not in a.ops.split(","):
                        continue
                    til = _pair(tile) != (0, 0)
                    got = bench_vae(a.device, dtype, [(w, h)], [t], (op,), (til,), tile if op == "encode" else 0,
                                    overlap, tile if op == "decode" else 0, overlap, a.warmup, a.repeats,
                                    a.heavy_repeats, vae=vae, log=lambda m: print(f"  {budget:g} GiB: {m}", flush=True),
                                    cudnn_benchmark={"policy": None, "on": True, "off": False}[a.cudnn_benchmark])
                    rows += [dict(r, layout=str(vae.layout()).replace("torch.", ""), budget_gib=budget,
                                  conv_limit="none" if conv is None else conv / GIB) for r in got]
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
