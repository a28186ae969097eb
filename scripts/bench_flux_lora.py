"""Benchmark: FLUX.1 LoRA training step, our trainer vs ComfyUI's TrainLoraNode, same model and data, one run.

Full FLUX.1-dev dimensions (19 double + 38 single blocks, hidden 3072) with random bf16 weights (no download),
batch 1, rank 16, AdamW, 256 T5 tokens (ComfyUI's padding), guidance input 1.0.

Modes: ours bf16 (+per-block checkpointing), ours fp8 base (FP8 tensor cores fwd + dgrad on sm_89+),
ours nvfp4 base (dequantized per call), ComfyUI TrainLoraNode (its defaults: checkpointing on, bf16).
Reports median s/step (after warm-up, CUDA-synchronised per step) and peak VRAM.

ComfyUI's source must be importable: --comfy DIR (default: $COMFYUI_DIR, ./.comfy_src, ./.comfyui).
`--tiny` runs a small model on CPU to check the script itself.

`--budgets 24,16,12,8` (issue #29): after the modes, the training node's path on a card of B GiB: the base in host
RAM, the GPU filled until B GiB stay usable (free plus torch's cache; a row is refused when more is usable after the
fill or after its run), the automatic memory plan applied to default settings; s/step, the trainer's peak above the
fill, the ratio to the resident fp8 run of the same process (`--modes fp8`), whether the validation loss fell and
how many keys of the saved LoRA ComfyUI's LoraLoader does not apply.

`--host-ops` (CPU only, no GPU needed): what the host does per training step, independent of GPU speed. FLUX.1's
block structure (19 double + 38 single blocks, 304 LoRA targets) with tiny widths (hidden 64), bf16 compute, so
the arithmetic is negligible and the time is dispatch/Python overhead. Per mode (bf16, fp8 as on a GPU without
FP8 GEMM = dequant, fp8-tc = FP8 tensor-core path forced through CPU `torch._scaled_mm`, nvfp4 = torch reference
dequant) and checkpointing on/off: aten ops per step (TorchDispatchMode count, forward + backward + optimizer;
bf16 compute, 64 image + 256 text tokens), Linear calls per step (incl. checkpoint recompute), fwd+bwd ops per
Linear call, host µs per step (median, 1 thread; timed in fp32 with 16 image + 16 text tokens, because CPU bf16
GEMMs are slow enough to hide the host work; the fp32 run has no LoRA casts, 2 x 608 ops fewer). The
optimizer+clip column is CPU's for-loop AdamW (on CUDA AdamW is fused: a handful of kernels).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import statistics
import sys
import time
import types

import _pack  # registers the pack as `seedvr2bw`
import torch

from bench_video import fill_gpu_to, release_cached
from seedvr2bw.optimization.runtime.device import free_device_bytes

FULL = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096,
            hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=19, depth_single_blocks=38, axes_dim=[16, 56, 56],
            theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True)
TINY = dict(FULL, vec_in_dim=32, context_in_dim=48, hidden_size=64, num_heads=4, depth=2, depth_single_blocks=2,
            axes_dim=[4, 6, 6])


def _stub_missing(names):
    """ComfyUI imports a few packages the GPU image lacks (av, torchsde) at import time only; stub them."""
    class _Dummy:
        def __init__(self, *a, **k):
            pass

    import importlib.abc
    import importlib.machinery

    missing = [n for n in names if n not in sys.modules and importlib.util.find_spec(n) is None]

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] in missing and fullname not in sys.modules:
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            return _module(spec.name)

        def exec_module(self, module):
            pass

    def _module(n):
        m = types.ModuleType(n)

        def _getattr(attr, _D=_Dummy):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _D
        m.__getattr__ = _getattr
        m.__path__ = []
        return m

    if missing:
        sys.meta_path.insert(0, _Finder())
    for n in missing:
        print(f"[bench] stubbed missing module {n} (and its submodules)", flush=True)


def setup_comfy(path, cpu):
    for cand in [path, os.environ.get("COMFYUI_DIR"), ".comfy_src", ".comfyui"]:
        if cand and os.path.isfile(os.path.join(cand, "comfy", "ldm", "flux", "model.py")):
            sys.path.insert(0, os.path.abspath(cand))
            break
    else:
        raise SystemExit("ComfyUI source not found: pass --comfy DIR")
    _stub_missing(["av", "torchsde", "trampoline"])
    from comfy.cli_args import args
    args.cpu = cpu
    import comfy.model_management  # noqa: F401


def build_model(cfg, device, dtype):
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models
    mc = comfy.supported_models.Flux(dict(cfg))
    mc.set_inference_dtype(dtype, None)
    m = comfy.model_base.Flux(mc, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in m.diffusion_model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5, generator=g)
            elif name.endswith("scale"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=g)
    m.eval()
    return comfy.model_patcher.ModelPatcher(m, load_device=torch.device(device),
                                            offload_device=torch.device("cpu"))


def make_dataset(res, cfg):
    from seedvr2bw.training.data import EncodedDataset, Item
    g = torch.Generator().manual_seed(1)
    lat = [torch.randn(16, res // 8, res // 8, generator=g)]
    cap = "a photo of sks"
    conds = {cap: torch.randn(256, cfg["context_in_dim"], generator=g)}
    pooled = {cap: torch.randn(cfg["vec_in_dim"], generator=g)}
    return EncodedDataset([Item("x", cap, (res, res), "0", None)], lat, conds, pooled)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def peak_reset(dev):
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak_gib(dev):
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")


PROFILE = None  # (mode, res) to profile one step of


def timed_steps(tr, dev, warmup: int, steps: int) -> tuple[list, list]:
    """``warmup + steps`` training steps, each CUDA-synchronised: (seconds of the timed steps, every loss)."""
    times, losses = [], []
    for i in range(warmup + steps):
        sync(dev)
        t0 = time.perf_counter()
        losses.append(tr.train_step())
        sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, losses


def bench_ours(mp, res, mode, cfgdims, dev, warmup, steps, outdir, cuda_graph="auto", compile_blocks="off",
               selective="auto"):
    from seedvr2bw.training.trainer import FluxLoraTrainer, TrainConfig
    ds = make_dataset(res, cfgdims)
    cfg = TrainConfig(rank=16, alpha=16, steps=10**6, learning_rate=1e-4, optimizer="adamw",
                      compute_dtype="bf16" if dev.type == "cuda" else "fp32",
                      base_precision="auto" if mode == "bf16" else mode, gradient_checkpointing=True,
                      output_dir=outdir, output_name=f"bench_{mode}_{res}", seed=0, cuda_graph=cuda_graph,
                      compile_blocks=compile_blocks, selective_checkpointing=selective)
    peak_reset(dev)
    tr = FluxLoraTrainer(mp.model.diffusion_model, cfg, ds, latent_format=mp.model.latent_format, device=dev)
    peak_reset(dev)  # peak while training (a bf16 base offloaded by fp8/nvfp4 set-up is not counted)
    try:
        if PROFILE and mode == PROFILE[0] and res == PROFILE[1]:
            for _ in range(2):
                tr.train_step()
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                tr.train_step()
                sync(dev)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60),
                  flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60),
                  flush=True)
        times, losses = timed_steps(tr, dev, warmup, steps)
        peak = peak_gib(dev)
        tc = any(getattr(lin, "_q_tensorcores", False) for lin, _, _ in tr.quant.saved) if tr.quant else None
        graphed = tr.graphed is not None and tr.graphed.failed is None and bool(tr.graphed.graphs)
        compiled = tr.forward.compiled
        selective_blocks = max(tr.forward._selective_n.values(), default=0)
    finally:
        tr.close()
    return {"impl": "ours", "mode": mode, "res": res, "median_s": statistics.median(times), "min_s": min(times),
            "step_s": [round(t, 4) for t in times],
            "peak_gib": peak, "cuda_graph": graphed, "compiled": compiled, "selective_blocks": selective_blocks,
            "sdpa": [b.name for b in tr.sdpa_backends or []][:1],
            "cuda_graph_error": tr.graphed.failed if tr.graphed is not None else None, "loss_first": losses[0], "loss_last": losses[-1],
            "lora_params": sum(p.numel() for p in tr.network.parameters()),
            "fp8_tensorcores": tc}


FILL_TOLERANCE_GIB = 0.25   # usable memory beyond the budget that voids a budget row


def check_budget(usable: int, budget_gib: float, when: str) -> None:
    """Raises when more than the budget (+ FILL_TOLERANCE_GIB) is usable: the row would measure a larger card."""
    if usable > (budget_gib + FILL_TOLERANCE_GIB) * 2**30:
        raise RuntimeError(
            f"{usable / 2**30:.2f} GiB usable {when}, more than the {budget_gib:g} GiB budget + "
            f"{FILL_TOLERANCE_GIB} GiB: memory held outside the fill was freed (a previous run's trainer or CUDA "
            "graphs?); no row for this budget")


class Collect(logging.Handler):
    """Appends the message of each warning (and above) it handles to ``messages``."""

    def __init__(self, messages: list):
        super().__init__(logging.WARNING)
        self.messages = messages

    def emit(self, record):
        self.messages.append(record.getMessage())


def lora_keys_missing(mp, path: str) -> int:
    """Keys of the LoRA file at ``path`` that ComfyUI's LoraLoader path (``comfy.sd.load_lora_for_models``) does
    not apply to ``mp``: the file keys it matches to no weight and the weights the model patcher refuses, each
    logged by ComfyUI as a warning."""
    import comfy.sd
    import comfy.utils
    lora = comfy.utils.load_torch_file(path)
    messages = []
    catch = Collect(messages)
    root = logging.getLogger()
    level = root.level
    root.addHandler(catch)
    root.setLevel(min(level, logging.WARNING))   # ComfyUI logs the misses as root warnings, which a higher level drops
    try:
        comfy.sd.load_lora_for_models(mp, None, lora, 1.0, 0.0)
    finally:
        root.removeHandler(catch)
        root.setLevel(level)
    return sum(m.startswith(("lora key not loaded", "NOT LOADED")) for m in messages)


def bench_budget(mp, res, budget_gib, cfgdims, dev, warmup, steps, outdir, precision="auto"):
    """The training node's path on a card of ``budget_gib``: the base back in host RAM (as the node leaves it), the
    GPU filled until that much stays usable, the automatic memory plan (training/memory_plan.py) made from what is
    usable and applied to default settings (blocks to swap "auto"; base precision ``precision``, default "auto"),
    then s/step and the trainer's
    peak above the fill. On the CPU (``--tiny``) the plan is made for a budget of that size and nothing is filled.

    The row also says whether training works there: ``loss_decreasing`` compares the validation loss (the node's:
    fixed sigmas and noise on the training image, so only the LoRA changes between the two) after the steps with
    the one before them, since a handful of step losses at random sigmas is mostly sigma noise; and
    ``lora_keys_missing`` counts the saved LoRA's keys that ComfyUI's LoraLoader does not apply."""
    import comfy.model_management as mm
    from seedvr2bw.training.memory_plan import DeviceBudget, PlanRequest, flux_dims, plan_training
    from seedvr2bw.training.trainer import FluxLoraTrainer, TrainConfig
    cuda = dev.type == "cuda"
    mm.free_memory(1e30, dev)
    dm = mp.model.diffusion_model
    hold = fill_gpu_to(budget_gib, dev) if cuda else []
    try:
        usable = free_device_bytes(dev) if cuda else None
        if cuda:
            check_budget(usable, budget_gib, "after the fill")
        request = PlanRequest(resolution=res, rank=16, cache_bytes=16 * (res // 8) ** 2 * 4, base_precision=precision)
        plan = plan_training(flux_dims(dm), request, DeviceBudget.of(dev, usable if cuda else int(budget_gib * 2**30)))
        cfg = plan.apply(TrainConfig(rank=16, alpha=16, steps=10**6, learning_rate=1e-4, optimizer="adamw",
                                     compute_dtype="bf16" if cuda else "fp32", base_precision=precision,
                                     blocks_to_swap=-1, gradient_checkpointing=True, output_dir=outdir,
                                     output_name=f"bench_budget{budget_gib:g}_{res}", seed=0))
        base = torch.cuda.memory_allocated(dev) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        ds = make_dataset(res, cfgdims)
        tr = FluxLoraTrainer(dm, cfg, ds, latent_format=mp.model.latent_format, device=dev, validation=ds)
        try:
            val_before = tr.validation_loss()
            stats0 = torch.cuda.memory_stats(dev) if cuda else {}
            times, losses = timed_steps(tr, dev, warmup, steps)
            stats1 = torch.cuda.memory_stats(dev) if cuda else {}
            swap = tr.block_runner.stats() if tr.block_runner is not None else {}
            peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**30 if cuda else float("nan")
            val_after = tr.validation_loss()
            lora_path = tr.save_lora()
        finally:
            tr.close()
            del tr
        missing = lora_keys_missing(mp, lora_path)
        usable_after_run = None
        if cuda:
            release_cached(dev)
            usable_after_run = free_device_bytes(dev)
            check_budget(usable_after_run, budget_gib, "after the run with the fill still held")
    finally:
        hold.clear()
        if cuda:
            release_cached(dev)
    return {"impl": "ours", "mode": f"{precision}@{budget_gib:g}GiB", "res": res, "budget_gib": budget_gib,
            "usable_gib_after_fill": None if usable is None else usable / 2**30,
            "usable_gib_after_run": None if usable_after_run is None else usable_after_run / 2**30,
            "plan": plan.line(), "median_s": statistics.median(times), "min_s": min(times),
            "step_s": [round(t, 4) for t in times], "peak_gib": peak, "loss_first": losses[0],
            "loss_last": losses[-1], "val_loss_before": val_before, "val_loss_after": val_after,
            "loss_decreasing": val_after < val_before, "lora_file": lora_path, "lora_keys_missing": missing,
            # allocator events over warm-up + timed steps: a retry synchronises and frees the cache, a cudaMalloc
            # is a driver call; either in every step would show as the swapped steps' unexplained cost
            "alloc_retries": stats1.get("num_alloc_retries", 0) - stats0.get("num_alloc_retries", 0),
            "device_mallocs": stats1.get("num_device_alloc", 0) - stats0.get("num_device_alloc", 0),
            # the streamed blocks over the same steps: a demand load or a pageable copy waits for its bytes
            "blockswap": {k: swap[k] for k in ("buffers", "prefetch", "copies", "bytes_copied", "pinned_copies",
                                               "pageable_copies", "prefetched", "demand_loads", "slot_hits")
                          if k in swap}}


def bench_trainloranode(mp, res, cfgdims, dev, warmup, steps):
    """ComfyUI's TrainLoraNode.execute on the same ModelPatcher; per-step times from a global optimizer hook.

    Two copies of the latent are passed: with a single latent dict 0.3.75 hits an UnboundLocalError
    (`multi_res`); batch size stays 1."""
    import comfy_extras.nodes_train as NT
    from torch.optim.optimizer import register_optimizer_step_post_hook
    ds = make_dataset(res, cfgdims)
    lat = ds.latents[0][None]
    cap = ds.items[0].caption
    cond = [[ds.conds[cap][None], {"pooled_output": ds.pooled[cap][None]}]]
    stamps = []

    def hook(opt, args, kwargs):
        sync(dev)
        stamps.append(time.perf_counter())
    h = register_optimizer_step_post_hook(hook)
    peak_reset(dev)
    try:
        out = NT.TrainLoraNode.execute(
            model=[mp], latents=[{"samples": lat}, {"samples": lat}], positive=[cond], batch_size=[1], steps=[warmup + steps + 1],
            grad_accumulation_steps=[1], learning_rate=[5e-4], rank=[16], optimizer=["AdamW"],
            loss_function=["MSE"], seed=[0], training_dtype=["bf16" if dev.type == "cuda" else "fp32"],
            lora_dtype=["bf16" if dev.type == "cuda" else "fp32"], algorithm=["LoRA"],
            gradient_checkpointing=[True], existing_lora=["[None]"])
    finally:
        h.remove()
    peak = peak_gib(dev)
    dts = [b - a for a, b in zip(stamps[:-1], stamps[1:])][warmup:]
    loss = None
    try:
        loss = out.result[2]["loss"][-1]
    except Exception:  # noqa: BLE001
        pass
    del out
    import comfy.model_management as mm
    mm.cleanup_models_gc()
    return {"impl": "TrainLoraNode", "mode": "bf16", "res": res, "median_s": statistics.median(dts),
            "min_s": min(dts), "peak_gib": peak, "loss_last": loss}


HOST_DIMS = dict(TINY, depth=19, depth_single_blocks=38)


def host_ops(modes, warmup, steps, outdir, top=0):
    """Counts aten ops / Linear calls and times the host per training step on the CPU (see module doc)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from seedvr2bw.training.trainer import FluxLoraTrainer, TrainConfig

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.c = Counter()
            self.opt = 0  # ops in clip_grad_norm_ + optimizer step + zero_grad (CPU: for-loop AdamW, GPU: fused)
            self.in_opt = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.c[str(func.overloadpacket)] += 1
            self.opt += self.in_opt
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    dev = torch.device("cpu")
    rows = []

    def trainer(mode, ckpt, dtype, res, tokens):
        from seedvr2bw.training.data import EncodedDataset, Item
        mp = build_model(HOST_DIMS, dev, dtype)
        g = torch.Generator().manual_seed(1)
        cap = "a photo of sks"
        ds = EncodedDataset([Item("x", cap, (res, res), "0", None)], [torch.randn(16, res // 8, res // 8, generator=g)],
                            {cap: torch.randn(tokens, HOST_DIMS["context_in_dim"], generator=g)},
                            {cap: torch.randn(HOST_DIMS["vec_in_dim"], generator=g)})
        cfg = TrainConfig(rank=16, alpha=16, steps=10**6, learning_rate=1e-4, optimizer="adamw",
                          compute_dtype="bf16" if dtype == torch.bfloat16 else "fp32",
                          base_precision={"bf16": "auto", "fp8-tc": "fp8"}.get(mode, mode),
                          gradient_checkpointing=ckpt, output_dir=outdir, output_name=f"hostops_{mode}", seed=0)
        tr = FluxLoraTrainer(mp.model.diffusion_model, cfg, ds, latent_format=mp.model.latent_format, device=dev)
        if mode == "fp8-tc" and tr.quant is not None:
            from seedvr2bw.training import quant as Q
            for lin, _, _ in tr.quant.saved:
                lin._q_tensorcores = lin._q_weight.shape[0] % 16 == 0 and lin._q_weight.shape[1] % 16 == 0
                lin._q_scale_rows = Q.fp8_scale_rows(lin._q_weight, lin._q_scale) if lin._q_tensorcores else None
        return tr

    for mode in modes:
        for ckpt in (True, False):
            # ops: bf16 compute as on the GPU (the per-step LoRA casts included), 64 image + 256 text tokens
            tr = trainer(mode, ckpt, torch.bfloat16, 128, 256)
            try:
                tr.train_step()
                calls = [0]

                def hook(m, a, o):
                    if isinstance(m, torch.nn.Linear):
                        calls[0] += 1
                h = torch.nn.modules.module.register_module_forward_hook(hook)
                try:
                    tr.train_step()
                finally:
                    h.remove()
                cm = Count()
                clip, step = torch.nn.utils.clip_grad_norm_, tr.optimizer.step

                def clip_w(*a, **k):
                    cm.in_opt = True
                    return clip(*a, **k)

                def step_w(*a, **k):
                    cm.in_opt = True
                    return step(*a, **k)
                torch.nn.utils.clip_grad_norm_, tr.optimizer.step = clip_w, step_w
                try:
                    with cm:
                        tr.train_step()
                finally:
                    torch.nn.utils.clip_grad_norm_ = clip
                    del tr.optimizer.step
            finally:
                tr.close()
            # time: fp32 (CPU bf16 GEMMs are slow and would dominate), 16 image + 16 text tokens: host work only
            tr = trainer(mode, ckpt, torch.float32, 64, 16)
            try:
                for _ in range(warmup):
                    tr.train_step()
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    tr.train_step()
                    times.append(time.perf_counter() - t0)
            finally:
                tr.close()
            n = sum(cm.c.values())
            r = {"mode": mode, "ckpt": ckpt, "ops_step": n, "ops_fwd_bwd": n - cm.opt, "ops_optim": cm.opt,
                 "linear_calls": calls[0], "ops_per_linear": (n - cm.opt) / max(1, calls[0]),
                 "host_us_step": statistics.median(times) * 1e6, "host_us_step_min": min(times) * 1e6,
                 "top_ops": cm.c.most_common(top)}
            rows.append(r)
            print("[host-ops]", json.dumps({k: v for k, v in r.items() if k != "top_ops"}), flush=True)
            if top:
                print("   ", ", ".join(f"{k}:{v}" for k, v in r["top_ops"]), flush=True)
    print("\n| mode | ckpt | aten ops/step | of which fwd+bwd | optimizer+clip | Linear calls/step "
          "| fwd+bwd ops per Linear call | host µs/step median (min) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {'on' if r['ckpt'] else 'off'} | {r['ops_step']} | {r['ops_fwd_bwd']} | "
              f"{r['ops_optim']} | {r['linear_calls']} | {r['ops_per_linear']:.1f} | {r['host_us_step']:.0f} "
              f"({r['host_us_step_min']:.0f}) |")
    return rows


def attention_backends(dev, resolutions, reps=20):
    """SDPA fwd+bwd per backend on FLUX's joint attention (24 heads x 128, 256 text + image tokens), bf16."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    rows = []
    for res in resolutions:
        L = 256 + (res // 16) ** 2
        q, k, v = (torch.randn(1, 24, L, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn(1, 24, L, 128, device=dev, dtype=torch.bfloat16)
        flops = 4 * L * L * 128 * 24
        for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel([be]):
                    fwd = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), rep=reps * 5)

                    def fb():
                        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                        torch.autograd.grad(o, (q, k, v), g)
                    both = do_bench(fb, rep=reps * 5)
                r = {"res": res, "tokens": L, "backend": be.name, "fwd_ms": fwd, "fwd_bwd_ms": both,
                     "fwd_tflops": flops / fwd / 1e9, "fwd_bwd_tflops": 3.5 * flops / both / 1e9}
            except Exception as exc:  # noqa: BLE001
                r = {"res": res, "tokens": L, "backend": be.name, "error": str(exc).splitlines()[0][:160]}
            rows.append(r)
            print("[attention]", json.dumps(r), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--comfy", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--res", default="512,1024")
    ap.add_argument("--modes", default="bf16,fp8,nvfp4,trainloranode")  # TrainLoraNode last: it leaves weight wrappers
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--outdir", default="/tmp/bench_flux_lora")
    ap.add_argument("--profile", default=None, help="mode,res of one step to profile, e.g. bf16,1024")
    ap.add_argument("--host-ops", action="store_true", help="CPU: aten ops, Linear calls and host µs per step")
    ap.add_argument("--top", type=int, default=0, help="--host-ops: also list the N most frequent aten ops")
    ap.add_argument("--attention", action="store_true", help="GPU: SDPA backends fwd+bwd on FLUX's attention shape")
    ap.add_argument("--cuda-graph", default="auto", help="ours: cuda_graph setting (auto|on|off|both)")
    ap.add_argument("--compile", default="off", help="ours: compile_blocks setting (auto|on|off|both)")
    ap.add_argument("--selective", default="auto",
                    help="ours: selective_checkpointing setting (auto|on|off|both)")
    ap.add_argument("--budgets", default="",
                    help="GiB list, e.g. 24,16,12,8: after --modes (use fp8 for the resident baseline), the node's "
                         "path with the automatic memory plan on the GPU filled until B GiB stay free; B:fp8 or "
                         "B:nvfp4 fixes the plan's base precision (e.g. 16:nvfp4)")
    a = ap.parse_args()
    if a.host_ops:
        setup_comfy(a.comfy, True)
        modes = [m for m in a.modes.split(",") if m != "trainloranode"] if a.modes != ap.get_default("modes") \
            else ["bf16", "fp8", "fp8-tc", "nvfp4"]
        rows = host_ops(modes, a.warmup, a.steps if a.steps != ap.get_default("steps") else 5, a.outdir, a.top)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"info": {"torch": torch.__version__, "commit": _pack.git_commit()}, "host_ops": rows},
                          f, indent=1)
        return
    if a.attention:
        rows = attention_backends(torch.device("cuda"), [int(r) for r in a.res.split(",")])
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"info": {"torch": torch.__version__, "commit": _pack.git_commit(),
                                    "device": torch.cuda.get_device_name()}, "attention": rows}, f, indent=1)
        return
    global PROFILE
    if a.profile:
        m, r = a.profile.split(",")
        PROFILE = (m, int(r))
    cpu = a.tiny or not torch.cuda.is_available()
    setup_comfy(a.comfy, cpu)
    dev = torch.device("cpu" if cpu else "cuda")
    dims = TINY if a.tiny else FULL
    dtype = torch.float32 if cpu else torch.bfloat16
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "dims": "tiny" if a.tiny else "FLUX.1 full", "commit": _pack.git_commit()}
    print("[bench]", info, flush=True)
    t0 = time.time()
    mp = build_model(dims, dev, dtype)
    import comfy.model_management as mm
    mm.load_models_gpu([mp], force_full_load=True)
    print(f"[bench] model built in {time.time() - t0:.1f}s, "
          f"{sum(p.numel() for p in mp.model.diffusion_model.parameters()) / 1e9:.2f} B params", flush=True)
    results = []
    ress = [int(r) for r in a.res.split(",")] if not a.tiny else [64]
    modes = a.modes.split(",")
    def choices(v):
        return ["off", "on"] if v == "both" else [v]
    graphs = [(g, c, s) for g in choices(a.cuda_graph) for c in choices(a.compile) for s in choices(a.selective)]
    for mode in modes:
        for res in ress:
            for graph in (graphs if mode != "trainloranode" else [None]):
                t1 = time.time()
                try:
                    if mode == "trainloranode":
                        r = bench_trainloranode(mp, res, dims, dev, a.warmup, a.steps)
                    else:
                        r = bench_ours(mp, res, mode, dims, dev, a.warmup, a.steps, a.outdir, *graph)
                except Exception as exc:  # noqa: BLE001
                    import traceback
                    traceback.print_exc()
                    r = {"impl": mode, "res": res, "error": f"{type(exc).__name__}: {exc}"}
                r["wall_s"] = round(time.time() - t1, 1)
                results.append(r)
                print("[bench]", json.dumps(r), flush=True)
    for res in ress:
        for spec in [x for x in a.budgets.split(",") if x]:
            b, _, prec = spec.partition(":")
            b, prec = float(b), prec or "auto"
            t1 = time.time()
            try:
                r = bench_budget(mp, res, b, dims, dev, a.warmup, a.steps, a.outdir, prec)
            except Exception as exc:  # noqa: BLE001  (an out-of-memory is a result here)
                import traceback
                traceback.print_exc()
                r = {"impl": "ours", "mode": f"{prec}@{b:g}GiB", "res": res, "error": f"{type(exc).__name__}: {exc}"}
            r["wall_s"] = round(time.time() - t1, 1)
            resident = next((x["median_s"] for x in results if x.get("mode") == "fp8" and x["res"] == res
                             and "error" not in x), None)
            if resident and "error" not in r:
                r["ratio_vs_resident_fp8"] = r["median_s"] / resident
            results.append(r)
            print("[bench]", json.dumps(r), flush=True)
    print("\n| impl | mode | CUDA graph | compiled | selective blocks | res | median s/step | min | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['impl']} | | | | | {r['res']} | ERROR {r['error'][:80]} | | |")
        else:
            print(f"| {r['impl']} | {r['mode']} | {r.get('cuda_graph', '')} | {r.get('compiled', '')} | "
                  f"{r.get('selective_blocks', '')} | {r['res']} | "
                  f"{r['median_s']:.3f} | "
                  f"{r['min_s']:.3f} | {r['peak_gib']:.1f} |")
    for res in ress:
        base = next((r["median_s"] for r in results if r["impl"] == "TrainLoraNode" and r["res"] == res
                     and "error" not in r), None)
        for r in results:
            if base and r["impl"] == "ours" and r["res"] == res and "error" not in r:
                print(f"[bench] {res}: ours {r['mode']} (CUDA graph {r.get('cuda_graph')}, compiled "
                      f"{r.get('compiled')}, selective blocks {r.get('selective_blocks')}) is "
                      f"{base / r['median_s']:.2f}x TrainLoraNode")
    for r in results:
        if "budget_gib" in r:
            ratio = f", {r['ratio_vs_resident_fp8']:.2f}x the resident fp8 run" if "ratio_vs_resident_fp8" in r else ""
            usable = "" if r["usable_gib_after_fill"] is None else \
                f"{r['usable_gib_after_fill']:.2f} GiB usable after the fill, "
            print(f"[bench] {r['res']} at {r['budget_gib']:g} GiB: {r['median_s']:.3f} s/step{ratio}; {usable}"
                  f"peak {r['peak_gib']:.1f} GiB; loss decreasing {r['loss_decreasing']} (validation loss "
                  f"{r['val_loss_before']:.5f} -> {r['val_loss_after']:.5f}); LoRA keys missing in ComfyUI's "
                  f"LoraLoader {r['lora_keys_missing']}; allocator retries {r['alloc_retries']}, cudaMallocs "
                  f"{r['device_mallocs']} in {a.warmup + a.steps} steps; BlockSwap {r['blockswap'] or 'off'}; "
                  f"{r['plan']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
