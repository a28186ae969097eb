"""Quantized linear layers with one interface: ``NVFP4Linear`` (NVFP4 weight, ComfyUI's layout: ``format.py``) and
``FP8Linear`` (FP8 E4M3 weight). A layer holds its tensors, loads and saves ComfyUI's checkpoint keys, and runs
the kernel ``dispatch.decide`` names for each input; ``NVFP4Linear.forward`` is one call into its launch plans
(``plans.py``).

``path="auto"`` (the default) takes the hardware policy's NVFP4 path for the device the layer runs on, asked when
it first runs there, so a layer loaded on the CPU and moved to a GPU runs that GPU's path; any explicit path
overrides it (still demoted where the device cannot run it, see ``dispatch.py``).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ..runtime import device_cache, policy
from . import dispatch, kernels, launch
from . import format as fmt
from . import rs_w4a16 as R
from . import wgmma_w4a16 as W
from .checkpoint import comfy_quant_tensor
from .fp4_gemm import fp4_gemm, fp4_gemm_operands, fp4_gemm_supported
from .format import NVFP4Tensor
from .plans import LaunchPlans, kernel_plan, make_plan

log = logging.getLogger(__name__)

# what the launch plans and the kernel decisions are built from: assigning one drops them
_PLAN_INPUTS = frozenset({"weight", "weight_scale", "weight_scale_2", "bias", "input_scale", "pre_quant_scale", "path",
                          "fidelity_kernel", "fp8_fast_accum", "in_features", "out_features"})
_WEIGHT_NAMES = frozenset({"weight", "weight_scale", "weight_scale_2"})
W4A16_TRITON_BROKEN: list = []   # why the Triton W4A16 kernel failed to build/run here (then never tried again)
FP8_NO_FAST_ACCUM: set = set()   # (M, K, N, device) where cuBLASLt refused bias + fast accumulation (fp8_speed)
TIMED: dict = {}                 # (M, N, K, device) -> the faster of rs_w4a16 and dequant_cublas there
_ANNOUNCED: set = set()          # (path, kernel, M) already logged
_SCRATCH: dict = device_cache.cache()


def _scratch(device, dtype, numel: int):
    """One flat buffer per device/dtype shared by every layer (the dequantized weight of the layer running now),
    grown on demand; growing frees the old one on the current stream, which the allocator may then reuse."""
    key = (str(device), dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        _SCRATCH.pop(key, None)
        buf = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf


def time_fastest(fns: dict, reps: int = 10) -> str:
    """Run each candidate once (warm-up, includes Triton autotuning), then time ``reps`` calls with CUDA events;
    return the fastest name. A candidate that raises is dropped (the last one is the safe fallback)."""
    best, best_t = None, float("inf")
    for name, fn in fns.items():
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - e.g. a Triton compile failure on this GPU / version
            log.warning("[SeedVR2-BW] NVFP4 %s kernel unavailable, using the next one: %s: %s", name,
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        t = start.elapsed_time(end)
        log.debug("fidelity candidate %s: %.4f ms", name, t / reps)
        if t < best_t:
            best, best_t = name, t
    return best


class _QuantLinearBase(torch.nn.Module):
    in_features: int
    out_features: int

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class NVFP4Linear(_QuantLinearBase):
    """nn.Linear replacement holding an NVFP4 weight. Buffers use ComfyUI's key names, so ``state_dict()``
    yields a ComfyUI NVFP4 layer (``weight``, ``weight_scale``, ``weight_scale_2``, [``input_scale``],
    ``comfy_quant``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=torch.bfloat16, path: str = "auto", fp8_fast_accum: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        pr, pc = fmt.roundup(out_features, 16), fmt.roundup(in_features, 16)
        sr, sc = fmt.swizzled_scale_shape(pr, pc // 16)
        self.register_buffer("weight", torch.zeros((pr, pc // 2), dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros((sr, sc), dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", None)
        self.register_buffer("pre_quant_scale", None)
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                       requires_grad=False) if bias else None
        self.path = path
        self.fp8_fast_accum = fp8_fast_accum
        self.fidelity_kernel = "auto"     # or force one of dispatch.FIDELITY_KERNELS
        self.derived_tensors: dict = {}   # tensors derived from the weights (the FP8 copy, the cast bias)
        self.decisions: dict = {}         # (M, dtype, device, autograd, W4A16 broken) -> dispatch.Decision
        self.plans = LaunchPlans()

    def __setattr__(self, name, value):
        if name in _PLAN_INPUTS:
            plans = self.__dict__.get("plans")
            if plans:
                plans.clear()
            decisions = self.__dict__.get("decisions")
            if decisions:
                decisions.clear()
            if name in _WEIGHT_NAMES and self.__dict__.get("derived_tensors"):
                self.derived_tensors.clear()
        super().__setattr__(name, value)

    def __getstate__(self):
        # copy.deepcopy / pickle: the plans' closures hold this layer's tensors; a copy makes its own
        state = dict(super().__getstate__())
        state["plans"] = LaunchPlans()
        return state

    def register_buffer(self, name, tensor, persistent=True):
        plans = self.__dict__.get("plans")
        if plans:
            plans.clear()
        super().register_buffer(name, tensor, persistent)

    def drop_derived(self) -> None:
        """Forget the tensors derived from the weights (BlockSwap, when the weights leave the GPU)."""
        self.derived_tensors.clear()

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_nvfp4(cls, t: NVFP4Tensor, bias=None, input_scale=None, path="auto", dtype=torch.bfloat16,
                   pre_quant_scale=None):
        n, k = t.shape
        m = cls(k, n, bias=bias is not None, device="meta", dtype=dtype, path=path)
        m.weight = t.packed
        m.weight_scale = t.block_scale
        m.weight_scale_2 = t.global_scale.float().reshape(())
        if bias is not None:
            m.bias = torch.nn.Parameter(bias.detach().to(dtype).to(t.packed.device), requires_grad=False)
        if input_scale is not None:
            m.register_buffer("input_scale", input_scale.float().reshape(()).to(t.packed.device))
        if pre_quant_scale is not None:
            m.register_buffer("pre_quant_scale", pre_quant_scale.to(t.packed.device))
        return m

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, path="auto", recipe="comfy", input_scale=None, dtype=None):
        w = linear.weight.detach()
        t = fmt.quantize_nvfp4(w.float() if w.dtype not in (torch.float32, torch.bfloat16, torch.float16) else w,
                               recipe=recipe, return_tensor=True)
        return cls.from_nvfp4(t, bias=linear.bias, input_scale=input_scale, path=path,
                              dtype=dtype or (linear.bias.dtype if linear.bias is not None else torch.bfloat16))

    @property
    def nvfp4(self) -> NVFP4Tensor:
        return NVFP4Tensor(self.weight, self.weight_scale, self.weight_scale_2, (self.out_features, self.in_features))

    def dequantize_weight(self, dtype=torch.float32) -> torch.Tensor:
        if dtype != torch.float32 and launch.triton_usable(self.weight):
            return kernels.dequantize_nvfp4_triton(self.weight, self.weight_scale, self.weight_scale_2,
                                                   (self.out_features, self.in_features), dtype=dtype)
        return self.nvfp4.dequantize(dtype)

    def weight_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_scale, self.weight_scale_2))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "comfy_quant"] = comfy_quant_tensor({"format": "nvfp4", "nibble_order": fmt.NIBBLE_ORDER})

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        state_dict.pop(prefix + "comfy_quant", None)
        for name in ("input_scale", "pre_quant_scale"):
            v = state_dict.get(prefix + name)
            if v is not None:
                if v.numel() == 1:
                    v = state_dict[prefix + name] = v.float().reshape(())
                self.register_buffer(name, torch.empty_like(v, device=self.weight.device))
        self.derived_tensors.clear()
        self.plans.clear()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _apply(self, fn, recurse=True):
        self.derived_tensors.clear()
        self.plans.clear()
        self.decisions.clear()
        return super()._apply(fn, recurse)

    # -- which kernel -------------------------------------------------------------------------------------
    def decision(self, x2: torch.Tensor) -> dispatch.Decision:
        """The path and kernel this layer runs for the 2-D input ``x2`` here, and why (asked once per M, dtype,
        device and autograd state; the first time logs one line)."""
        grad = torch.is_grad_enabled() and x2.requires_grad
        key = (x2.shape[0], x2.dtype, x2.device, grad, bool(W4A16_TRITON_BROKEN))
        d = self.decisions.get(key)
        if d is None:
            d = self.decisions[key] = dispatch.decide("nvfp4", self.path, x2.shape[0], self._site(x2, grad),
                                                      self.fidelity_kernel)
            _announce(d, x2.shape[0])
        return d

    def _site(self, x2: torch.Tensor, grad: bool) -> dispatch.Site:
        device, n, k = x2.device, self.out_features, self.in_features
        return dispatch.Site(
            cuda=launch.device_is_cuda(device), triton=launch.triton_usable(x2),
            half=x2.dtype in (torch.bfloat16, torch.float16), dims16=not (k % 16 or n % 16),
            w4a16_broken=W4A16_TRITON_BROKEN[-1] if W4A16_TRITON_BROKEN else None,
            policy_path=lambda: policy.get_policy(device).nvfp4_gemm,
            fp4_gemm=lambda: fp4_gemm_supported(device),
            wgmma=lambda: W.usable(x2, n, k),
            rs=lambda: not grad and R.usable(x2, n, k))

    # -- forward --------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plans.run(self, x)

    def forward_full(self, x: torch.Tensor) -> torch.Tensor:
        """The complete forward (dispatch, every check); then a launch plan is recorded for x's shape."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.pre_quant_scale is not None:
            x2 = x2 * self.pre_quant_scale.to(x2.dtype)
        d = self.decision(x2)
        kernel = self._timed(x2) if d.kernel == "rs_or_dequant" else d.kernel
        y = self.run_kernel(kernel, x2).reshape(*shape[:-1], self.out_features)
        if d.path in ("fidelity", "fp8_speed") and (shape, x.dtype, x.get_device()) not in self.plans:
            if kernel == "w4a16_triton" and W4A16_TRITON_BROKEN:
                kernel = "dequant_cublas"           # it failed to build here: plan what ran instead
            self.plans.record(x, make_plan(self, x, x2, kernel))
        return y

    def run_kernel(self, kernel: str, x2: torch.Tensor) -> torch.Tensor:
        """``kernel`` (a name of ``dispatch.KERNEL_DOC``) on the 2-D input x2, output in x2's dtype."""
        return getattr(self, "_k_" + kernel)(x2)

    def _timed(self, x2) -> str:
        key = (x2.shape[0], self.out_features, self.in_features, str(x2.device))
        choice = TIMED.get(key)
        if choice is None:
            choice = TIMED[key] = time_fastest(self._rs_vs_dequant(x2))
            log.info("[SeedVR2-BW] NVFP4 fidelity M=%d, %dx%d: %s (timed against the other)", x2.shape[0],
                     self.in_features, self.out_features, choice)
        return choice

    def _rs_vs_dequant(self, x2) -> dict:
        """The two candidates as later calls run them: through their launch plans (the host time of a full call
        is several times a plan's and decided the choice at M = 1024 - 2048 on the H100)."""
        out_shape = (x2.shape[0], self.out_features)

        def planned(kernel):
            self.run_kernel(kernel, x2)                  # compiles, self-tests, then the plan can be made
            try:
                plan = kernel_plan(self, x2, kernel, out_shape)
            except Exception:  # noqa: BLE001 - no plan: time the full call
                plan = None
            if plan is not None and x2.is_contiguous():
                return lambda: plan(x2)
            return lambda: self.run_kernel(kernel, x2)
        return {"rs_w4a16": planned("rs_w4a16"), "dequant_cublas": planned("dequant_cublas")}

    def padded_input(self, x2):
        """x2 with K zero-padded to the weight's padded K (a multiple of 16)."""
        kp = self.weight.shape[1] * 2
        if x2.shape[1] != kp:
            x2 = F.pad(x2, (0, kp - x2.shape[1]))
        return x2

    def bias_as(self, dtype):
        """The bias in the activations' dtype (None without a bias); the last conversion is kept while the bias
        keeps its storage (block swap gives it new storage: converted again, the old copy dropped)."""
        b = self.bias
        if b is None or b.dtype == dtype:
            return b
        key = (b.data_ptr(), b.device, dtype)
        hit = self.derived_tensors.get("bias_as")
        if hit is None or hit[0] != key:
            hit = self.derived_tensors["bias_as"] = (key, b.to(dtype))
        return hit[1]

    def scratch_weight(self, x2, dtype):
        """[N, K] view of the device's shared scratch weight for the dequantize + GEMM kernel (its stores keep the
        weight in L2 for the GEMM), or None where it must not be used: off CUDA / Triton, or when autograd would
        keep the weight for the backward (the next layer overwrites the scratch)."""
        if (not (launch.on_cuda(x2) and launch.triton_usable(self.weight))
                or (torch.is_grad_enabled() and x2.requires_grad)):
            return None
        n, k = self.out_features, self.in_features
        return _scratch(x2.device, dtype, n * k)[: n * k].view(n, k)

    def derived_bytes(self, device) -> int:
        """GPU bytes this layer derives from its weights on ``device`` (the FP8 copy on the fp8_speed path), so that
        a memory plan counts what runs there, not only the stored NVFP4 bytes."""
        path = self.path if self.path != "auto" else policy.get_policy(device).nvfp4_gemm
        return self.out_features * (self.in_features + 4) if path == "fp8_speed" else 0

    def scratch_bytes(self, device) -> int:
        """The most bytes of the device's shared scratch weight one call may fill (the fidelity path's dequantize +
        GEMM kernel; a memory plan may switch any layer to that path)."""
        return 2 * self.out_features * self.in_features if torch.device(device).type == "cuda" else 0

    def fp8_weight(self, device):
        """The NVFP4 weight as FP8 E4M3 with per-output-channel scales (made once per device)."""
        key = ("fp8", str(device))
        if key not in self.derived_tensors:
            if launch.triton_usable(self.weight):
                self.derived_tensors[key] = kernels.nvfp4_to_fp8_rowwise_triton(
                    self.weight, self.weight_scale, self.weight_scale_2, (self.out_features, self.in_features))
            else:
                self.derived_tensors[key] = fmt.nvfp4_to_fp8_rowwise(self.nvfp4)
        return self.derived_tensors[key]

    def fp8_fast_accum_for(self, m: int, device) -> bool:
        return self.fp8_fast_accum and (m, self.in_features, self.out_features, str(device)) not in FP8_NO_FAST_ACCUM

    # -- the kernels (dispatch.KERNEL_DOC) ------------------------------------------------------------------
    def _k_reference(self, x2):
        w = self.nvfp4.dequantize(torch.float32)
        b = self.bias.float() if self.bias is not None else None
        return F.linear(x2.float(), w, b).to(x2.dtype)

    def _k_w4a16_triton(self, x2):
        try:
            return kernels.w4a16_linear(self.padded_input(x2), self.weight, self.weight_scale, self.weight_scale_2,
                                        self.out_features, bias=self.bias_as(x2.dtype)).to(x2.dtype)
        except Exception as exc:  # noqa: BLE001 - Triton compile failure on this GPU / version
            W4A16_TRITON_BROKEN.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            log.warning("[SeedVR2-BW] NVFP4 fused W4A16 kernel unavailable, using dequant + cuBLAS: %s",
                        W4A16_TRITON_BROKEN[-1])
            return self._k_dequant_cublas(x2)

    def _k_w4a16_wgmma(self, x2):
        xp = self.padded_input(x2)
        if xp.stride(1) != 1:
            xp = xp.contiguous()
        y = W.wgmma_linear(xp, self.weight, self.weight_scale, self.weight_scale_2, self.out_features,
                           self.bias_as(x2.dtype))
        return self._k_w4a16_triton(x2) if y is None else y.to(x2.dtype)

    def _k_rs_w4a16(self, x2):
        y = R.rs_linear(x2.contiguous(), self.weight, self.weight_scale, self.weight_scale_2, self.out_features,
                        self.bias_as(x2.dtype))
        return self._k_dequant_cublas(x2) if y is None else y

    def _k_dequant_cublas(self, x2):
        """Dequantize into the shared scratch weight (stores kept in L2: the GEMM reads them straight back) +
        one cuBLAS call."""
        dtype = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        w = self.scratch_weight(x2, dtype)
        if w is None:
            w = self.dequantize_weight(dtype)
        else:
            kernels.dequantize_nvfp4_triton(self.weight, self.weight_scale, self.weight_scale_2,
                                            (self.out_features, self.in_features), dtype=dtype, out=w, l2_keep=True)
        b = self.bias.to(dtype) if self.bias is not None else None
        return F.linear(x2.to(dtype), w, b).to(x2.dtype)

    def _k_fp8_rowwise(self, x2):
        w8, sw = self.fp8_weight(x2.device)
        xq, sx = kernels.quantize_rows_fp8(x2)
        b = self.bias.to(torch.bfloat16) if self.bias is not None else None
        fast = self.fp8_fast_accum_for(x2.shape[0], x2.device)

        def mm(fast_accum):
            return torch._scaled_mm(xq, w8.t(), scale_a=sx.reshape(-1, 1), scale_b=sw.reshape(1, -1),
                                    out_dtype=torch.bfloat16, bias=b, use_fast_accum=fast_accum)
        try:
            y = mm(fast)
        except RuntimeError as exc:
            # cuBLASLt (H100, torch 2.11 / CUDA 13) has no row-wise FP8 kernel with a bias epilogue and fast
            # accumulation for M <= 48 at K >= 6912 (docs/PERFORMANCE.md §8); it does have one with
            # full-precision accumulation, so this shape uses that from now on (the launch plan too)
            if not (fast and b is not None and "NOT_SUPPORTED" in str(exc)):
                raise
            FP8_NO_FAST_ACCUM.add((x2.shape[0], self.in_features, self.out_features, str(x2.device)))
            log.info("[SeedVR2-BW] NVFP4 fp8_speed: cuBLASLt has no FP8 GEMM with bias and fast accumulation for "
                     "%dx%dx%d; this shape accumulates in full precision", x2.shape[0], self.in_features,
                     self.out_features)
            y = mm(False)
        return y.to(x2.dtype)

    def _k_fp4_gemm(self, x2):
        out_dtype = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        ops = fp4_gemm_operands(self.padded_input(x2), self.nvfp4, self.input_scale)
        y = fp4_gemm(ops, out_dtype, None)
        y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x2.dtype)


def _announce(d: dispatch.Decision, m: int) -> None:
    key = (d.path, d.kernel, m)
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        log.info("%s", d.line("NVFP4", m))


class FP8Linear(_QuantLinearBase):
    """nn.Linear replacement holding an FP8 E4M3 weight (w ~= weight * weight_scale, scale 0-d or per row).

    The weight stays FP8 in memory; each call casts it to the compute dtype (``mode="cast"``, default, any
    device). ``mode="scaled_mm"`` (sm_89+) runs ``torch._scaled_mm`` with per-token FP8 activations instead.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=torch.bfloat16, mode="cast"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros((out_features, in_features), dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer("weight_scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", None)
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                       requires_grad=False) if bias else None
        self.mode = mode
        self.compute_dtype = dtype
        self.decisions: dict = {}        # (mode, on CUDA) -> dispatch.Decision

    @classmethod
    def from_fp8(cls, w8, scale=None, bias=None, dtype=torch.bfloat16, mode="cast", input_scale=None):
        n, k = w8.shape
        m = cls(k, n, bias=bias is not None, device="meta", dtype=dtype, mode=mode)
        m.weight = w8 if w8.dtype == torch.float8_e4m3fn else w8.to(torch.float8_e4m3fn)
        m.weight_scale = (scale if scale is not None else torch.ones(())).float().to(w8.device)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias.detach().to(dtype).to(w8.device), requires_grad=False)
        if input_scale is not None:
            m.register_buffer("input_scale", input_scale.float().reshape(()).to(w8.device))
        return m

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, dtype=None, mode="cast"):
        w8, s = fmt.quantize_fp8_per_tensor(linear.weight.detach())
        return cls.from_fp8(w8, s, linear.bias, dtype=dtype or linear.weight.dtype, mode=mode)

    def weight_nbytes(self) -> int:
        return self.weight.numel() + self.weight_scale.numel() * 4

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "comfy_quant"] = comfy_quant_tensor({"format": "float8_e4m3fn"})

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        state_dict.pop(prefix + "comfy_quant", None)
        v = state_dict.get(prefix + "input_scale")
        if v is not None:
            v = state_dict[prefix + "input_scale"] = v.float().reshape(())
            self.register_buffer("input_scale", torch.empty_like(v, device=self.weight.device))
        ws = state_dict.get(prefix + "weight_scale")
        if ws is not None and ws.shape != self.weight_scale.shape:
            self.weight_scale = torch.empty_like(ws, dtype=torch.float32, device=self.weight_scale.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def dequantize_weight(self, dtype=torch.bfloat16, out=None):
        """The weight in ``dtype``; written into ``out`` (an [N, K] buffer of that dtype) when given."""
        s = self.weight_scale
        s = s.reshape(-1, 1) if s.numel() > 1 else s
        s = s.to(dtype) if dtype != torch.float32 else s
        if out is None:
            return self.weight.to(dtype) * s
        return out.copy_(self.weight).mul_(s)

    def scratch_weight(self, x2, dtype):
        """[N, K] view of the device's shared scratch weight for the cast path, or None where a fresh buffer is
        needed: off CUDA, or when autograd keeps the weight for the backward (the next layer overwrites it).
        One buffer for every layer: per-call weight copies of different sizes fragment a tight budget."""
        if not x2.is_cuda or (torch.is_grad_enabled() and x2.requires_grad):
            return None
        n, k = self.out_features, self.in_features
        return _scratch(x2.device, dtype, n * k)[: n * k].view(n, k)

    def scratch_bytes(self, device) -> int:
        """The most bytes of the device's shared scratch weight one call may fill (the cast path on CUDA)."""
        return 2 * self.out_features * self.in_features if torch.device(device).type == "cuda" and \
            self.mode == "cast" else 0

    def decision(self, x2: torch.Tensor) -> dispatch.Decision:
        """The kernel this layer runs for the 2-D input x2 here, and why (the FP8 choice does not depend on M)."""
        key = (self.mode, x2.is_cuda)
        d = self.decisions.get(key)
        if d is None:
            site = dispatch.Site(cuda=x2.is_cuda, dims16=not (self.in_features % 16 or self.out_features % 16))
            d = self.decisions[key] = dispatch.decide("fp8", self.mode, x2.shape[0], site)
        return d

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.decision(x2).kernel == "fp8_scaled_mm":
            xq, sx = kernels.quantize_rows_fp8(x2)
            sw = self.weight_scale.float()
            sw = sw.reshape(1, -1) if sw.numel() > 1 else sw.reshape(1, 1).expand(1, self.out_features).contiguous()
            b = self.bias.to(torch.bfloat16) if self.bias is not None else None
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=sx.reshape(-1, 1), scale_b=sw,
                                 out_dtype=torch.bfloat16, bias=b).to(x.dtype)
        else:
            dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else self.compute_dtype
            w = self.dequantize_weight(dtype, out=self.scratch_weight(x2, dtype))
            y = F.linear(x2.to(dtype), w, self.bias.to(dtype) if self.bias is not None else None).to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)
