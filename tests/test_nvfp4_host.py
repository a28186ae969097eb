"""NVFP4Linear launch plans (the low-host-overhead per-call path), on the CPU: the GPU is faked through the
seams in launch.py (``on_cuda``, ``device_is_cuda``, ``raw_stream``) and the Triton kernels by stand-ins that
record what their launcher receives. A plan must hand the launcher exactly what the full forward hands it
(same kernel, grid, constexprs, integers, weight-side tensors), so the GPU computes the same bits."""
import pytest
import torch

from seedvr2bw.optimization.nvfp4 import kernels as K
from seedvr2bw.optimization.nvfp4 import launch
from seedvr2bw.optimization.nvfp4 import linear as L
from seedvr2bw.optimization.nvfp4.linear import NVFP4Linear

pytestmark = pytest.mark.skipif(not K.HAS_TRITON, reason="the kernels module defines its kernels only with Triton")


class _Compiled:
    function = "fn-handle"
    packed_metadata = "metadata"

    def __init__(self, name, log):
        self.name, self.log, self.fail = name, log, False

    def run(self, *args):
        if self.fail:
            raise TypeError("launcher API differs")
        self.log.append(("run", self.name, args))


class _Jit:
    def __init__(self, name, log):
        self.name, self.log = name, log
        self.compiled = _Compiled(name, log)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("bind", self.name, grid, args, kw))
            return self.compiled
        return launch


@pytest.fixture
def fake_gpu(monkeypatch):
    log = []
    monkeypatch.setattr(launch, "on_cuda", lambda t: True)
    monkeypatch.setattr(launch, "device_is_cuda", lambda d: True)
    monkeypatch.setattr(launch, "raw_stream", lambda index: 1234)
    monkeypatch.setitem(launch.SM_COUNT, "cpu", 132)
    monkeypatch.setattr(launch, "hooks_set", lambda: False)
    monkeypatch.setattr(launch, "FAST_LAUNCH", [True])
    monkeypatch.setattr(launch, "FAST_CACHE", {})
    jits = {}
    for module, name in ((K, "w4a16_swab_kernel"), (launch, "splitk_reduce_kernel"), (K, "act_fp8_row_kernel"),
                         (K, "dequant_kernel")):
        jits[name] = _Jit(name, log)
        monkeypatch.setattr(module, name, jits[name])
    # the dequantize kernel is autotuned: the cached relaunch keys on the config the autotuner chose
    jits["dequant_kernel"].best_config = type("Cfg", (), {"kwargs": {"BLOCK_R": 32, "BLOCK_C": 64}})()

    def fake_scaled_mm(a, b, scale_a=None, scale_b=None, out_dtype=torch.bfloat16, bias=None, use_fast_accum=False):
        log.append(("scaled_mm", (a, b, scale_a, scale_b, out_dtype, bias, use_fast_accum)))
        return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    return log, jits


def _norm(args, layer):
    """Launcher arguments with fresh allocations replaced by (dtype, numel) and layer tensors by their pointer."""
    own = {t.data_ptr(): name for name, t in
           (("weight", layer.weight), ("weight_scale", layer.weight_scale), ("g", layer.weight_scale_2),
            ("bias", layer.bias if layer.bias is not None else layer.weight_scale_2))}
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(("T", a.dtype, own.get(a.data_ptr(), a.numel())))
        else:
            out.append(a)
    return out


def _runs(log, since=0):
    return [e for e in log[since:] if e[0] == "run"]


def _layer(n, k, bias=True, path="fidelity", dtype=torch.bfloat16):
    layer = NVFP4Linear(k, n, bias=bias, dtype=dtype, path=path)
    layer.weight_scale_2.fill_(0.5)
    return layer


@pytest.mark.parametrize("m,n,k,splits", [(1, 256, 4096, True), (64, 256, 128, False), (3, 300, 1024, None)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_plan_launches_what_the_full_forward_launches(fake_gpu, m, n, k, splits, bias, dtype):
    log, _ = fake_gpu
    layer = _layer(n, k, bias, dtype=dtype)
    x = torch.randn(2, m, k).to(dtype)
    y0 = layer(x)                                   # full forward: compiles (binder), makes the plan
    assert y0.shape == (2, m, n) and y0.dtype == dtype
    assert callable(layer.plans.for_input(x))
    mark = len(log)
    ref = layer.forward_full(x)                    # full forward again: cached relaunch
    full = _runs(log, mark)
    mark = len(log)
    y = layer(x)                                    # the plan
    planned = _runs(log, mark)
    assert not [e for e in log[mark:] if e[0] == "bind"]
    assert y.shape == ref.shape and y.dtype == ref.dtype and y.is_contiguous()
    assert len(planned) == len(full) >= 1
    if splits is not None:
        assert (len(full) == 2) == splits
    for (_, name_a, args_a), (_, name_b, args_b) in zip(full, planned):
        assert name_a == name_b
        assert args_a[:7] == args_b[:7]             # grid, stream, function, metadata, hooks
        assert _norm(args_a[9:], layer) == _norm(args_b[9:], layer)
    # the plan writes its own output (and partials): the launcher received the tensor it returns
    out_arg = planned[0][2][9 + 5] if len(planned) == 1 else planned[1][2][9 + 3]
    assert out_arg.data_ptr() == y.data_ptr()


def test_fp8_plan_launches_and_calls_scaled_mm_like_the_full_forward(fake_gpu):
    log, _ = fake_gpu
    layer = _layer(64, 128, path="fp8_speed")
    x = torch.randn(3, 5, 128).to(torch.bfloat16)
    layer(x)
    assert callable(layer.plans.for_input(x))
    mark = len(log)
    ref = layer.forward_full(x)
    full = log[mark:]
    mark = len(log)
    y = layer(x)
    planned = log[mark:]
    assert [e[0] for e in full] == [e[0] for e in planned] == ["run", "scaled_mm"]
    assert full[0][1:2] == planned[0][1:2] and full[0][2][:9] == planned[0][2][:9]
    assert _norm(full[0][2][9:], layer) == _norm(planned[0][2][9:], layer)
    fa, pa = full[1][1], planned[1][1]
    for a, b in zip(fa, pa):
        if isinstance(a, torch.Tensor):
            assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
        else:
            assert a == b
    assert fa[1].data_ptr() == pa[1].data_ptr() and fa[3].data_ptr() == pa[3].data_ptr()   # cached weight side
    assert fa[5].data_ptr() == pa[5].data_ptr() == layer.bias.data_ptr()
    assert pa[0].data_ptr() == planned[0][2][9 + 1].data_ptr()       # the FP8 activation the kernel wrote
    assert y.shape == ref.shape == (3, 5, 64)


def test_fp8_shape_without_a_fast_accum_kernel_falls_back_and_plans_that(fake_gpu, monkeypatch):
    """cuBLASLt has no row-wise FP8 GEMM with bias + fast accumulation for some small-M shapes (H100: M <= 48,
    K >= 6912): that call is retried with full-precision accumulation, and the launch plan keeps that choice;
    other errors, and other shapes, are not affected."""
    from seedvr2bw.optimization.nvfp4 import linear as L
    log, _ = fake_gpu
    monkeypatch.setattr(L, "FP8_NO_FAST_ACCUM", set())
    real = torch._scaled_mm

    def picky_scaled_mm(a, b, scale_a=None, scale_b=None, out_dtype=torch.bfloat16, bias=None, use_fast_accum=False):
        if bias is not None and use_fast_accum and a.shape[0] <= 48:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic`")
        return real(a, b, scale_a, scale_b, out_dtype, bias, use_fast_accum)

    monkeypatch.setattr(torch, "_scaled_mm", picky_scaled_mm)
    layer = _layer(64, 128, path="fp8_speed")
    x = torch.randn(16, 128).to(torch.bfloat16)
    y0 = layer(x)
    assert [e[1][6] for e in log if e[0] == "scaled_mm"] == [False]      # retried without fast accumulation
    assert L.FP8_NO_FAST_ACCUM == {(16, 128, 64, "cpu")}
    mark = len(log)
    y = layer(x)                                       # the plan
    assert callable(layer.plans.for_input(x))
    assert [e[1][6] for e in log[mark:] if e[0] == "scaled_mm"] == [False]
    assert y.shape == y0.shape == (16, 64)
    big = torch.randn(64, 128).to(torch.bfloat16)
    mark = len(log)
    layer(big)
    assert [e[1][6] for e in log[mark:] if e[0] == "scaled_mm"] == [True]  # other shapes keep fast accumulation

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(torch, "_scaled_mm", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _layer(64, 128, path="fp8_speed")(torch.randn(8, 128).to(torch.bfloat16))


def test_no_plan_where_the_call_is_not_a_single_fused_launch(fake_gpu):
    layer = _layer(256, 512)
    x = torch.randn(300, 512).to(torch.bfloat16)
    layer.plans.record(x, None)
    layer.pre_quant_scale = torch.ones(512)
    assert not layer.plans                           # assigning a buffer clears the plans
    x = torch.randn(4, 512).to(torch.bfloat16)
    layer(x)
    assert layer.plans.for_input(x) is None
    odd = _layer(64, 72)                               # K padded to 80: the full forward pads every call
    xo = torch.randn(4, 72).to(torch.bfloat16)
    odd(xo)
    assert odd.plans.for_input(xo) is None


@pytest.mark.parametrize("bias", [True, False])
def test_dequant_plan_launches_and_multiplies_like_the_full_forward(fake_gpu, monkeypatch, bias):
    """M > dispatch.W4A16_MAX_M: dequantize + cuBLAS. The plan launches the dequantize kernel as the full forward does
    (same grid, integers, constexprs, weight-side tensors; the device's shared scratch weight as the output,
    with the stores kept in L2) and multiplies by what it wrote."""
    log, _ = fake_gpu
    products = []
    real_linear = torch.nn.functional.linear

    def spy_linear(x, w, b=None):
        products.append((x, w, b))
        return real_linear(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", spy_linear)
    layer = _layer(256, 512, bias=bias)
    x = torch.randn(2, 300, 512).to(torch.bfloat16)
    mark = len(log)
    y0 = layer(x)                                     # full forward: binds (autotunes) the kernel, makes the plan
    assert callable(layer.plans.for_input(x))
    full = [e for e in log[mark:] if e[0] == "bind"]
    mark = len(log)
    y = layer(x)
    (run,) = _runs(log, mark)
    assert run[1] == "dequant_kernel" and not [e for e in log[mark:] if e[0] == "bind"]
    grid = full[0][2]({"BLOCK_R": 32, "BLOCK_C": 64})
    assert tuple(run[2][:3]) == tuple(grid) + (1,) * (3 - len(grid))
    assert _norm(full[0][3], layer) == _norm(run[2][9:9 + len(full[0][3])], layer)
    # the tuned block sizes, then the constexprs the full call passed (the decode choice)
    assert run[2][9 + len(full[0][3]):] == (32, 64) + tuple(full[0][4].values())
    assert full[0][4] == {"ASM_DECODE": K.W4A16_ASM_DECODE, "L2_KEEP": True}
    assert run[2][9 + 4].data_ptr() == full[0][3][4].data_ptr()      # both write the shared scratch weight
    (xp, wp, bp), (xf, wf, bf) = products[-1], products[0]
    assert wp is run[2][9 + 4] and wp.shape == wf.shape == (256, 512) and wp.dtype == wf.dtype
    assert bp is layer.bias and (bf is None) == (not bias)
    assert y.shape == y0.shape == (2, 300, 256)


def test_plans_are_dropped_when_their_inputs_change(fake_gpu):
    log, _ = fake_gpu
    layer = _layer(256, 512)
    x = torch.randn(4, 512).to(torch.bfloat16)
    layer(x)
    assert layer.plans
    layer.fidelity_kernel = "dequant"
    assert not layer.plans
    layer.fidelity_kernel = "auto"
    layer(x)
    layer.load_state_dict(layer.state_dict())
    assert not layer.plans
    layer(x)
    layer.to(torch.device("cpu"))
    assert not layer.plans
    layer(x)
    # block swap re-points the storage (t.data = ...): the plan hands the launcher the new pointer
    layer.weight.data = layer.weight.data.clone()
    mark = len(log)
    layer(x)
    (run,) = _runs(log, mark)
    assert run[2][9 + 1].data_ptr() == layer.weight.data_ptr()


def test_misaligned_input_takes_the_full_forward(fake_gpu):
    log, _ = fake_gpu
    layer = _layer(256, 512)
    buf = torch.randn(4 * 512 + 1).to(torch.bfloat16)
    x = buf[1:].view(4, 512)                           # contiguous, 2 bytes past a 16-byte boundary
    layer(x)
    plan = layer.plans.for_input(x)
    assert plan is None or plan(x) is None
    y = layer(x)
    assert y.shape == (4, 256)


def test_launcher_error_turns_fast_launch_off_and_falls_back(fake_gpu):
    log, jits = fake_gpu
    layer = _layer(256, 512)
    x = torch.randn(4, 512).to(torch.bfloat16)
    layer(x)
    jits["w4a16_swab_kernel"].compiled.fail = True
    mark = len(log)
    y = layer(x)
    assert y.shape == (4, 256)
    assert launch.FAST_LAUNCH[0] is False and not any(callable(p) for p in layer.plans.values())
    assert [e for e in log[mark:] if e[0] == "bind"]  # the normal Triton launch ran it


def test_hook_detection_understands_hook_chains():
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not launch.hook_active(None)
    assert not launch.hook_active(Chain([]))
    assert launch.hook_active(Chain([print]))
    assert launch.hook_active(print)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bit equality of plan and full forward)")
@pytest.mark.parametrize("path", ["fidelity", "fp8_speed"])
@pytest.mark.parametrize("m,n,k", [(1, 3072, 3072), (16, 6912, 2560), (16, 2560, 6912), (64, 640, 2560),
                                   (256, 1000, 3072), (1100, 640, 2560), (4096, 3072, 3072)])
def test_plan_gives_the_same_bits_as_the_full_forward_on_cuda(path, m, n, k):
    from seedvr2bw.optimization.nvfp4 import format as fmt
    if path == "fp8_speed" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm_89+")
    g = torch.Generator().manual_seed(m + n)
    t = fmt.quantize_nvfp4(torch.randn(n, k, generator=g) * 0.05, return_tensor=True)
    layer = NVFP4Linear.from_nvfp4(t, bias=torch.randn(n, generator=g), path=path).to("cuda")
    x = torch.randn(1, m, k, generator=g).to(torch.bfloat16).to("cuda")
    first = layer(x)
    planned = [layer(x) for _ in range(3)]
    full = layer.forward_full(x)
    torch.cuda.synchronize()
    if launch.FAST_LAUNCH[0]:
        assert callable(layer.plans.for_input(x))
    for y in planned:
        assert y.shape == full.shape == first.shape and torch.equal(y, full) and torch.equal(y, first)


def test_a_deep_copy_launches_with_its_own_tensors(fake_gpu):
    import copy
    log, _ = fake_gpu
    layer = _layer(256, 512)
    x = torch.randn(4, 512).to(torch.bfloat16)
    layer(x)
    layer(x)
    twin = copy.deepcopy(layer)
    assert not twin.plans and layer.plans
    for _ in range(2):
        mark = len(log)
        twin(x)
    (run,) = _runs(log, mark)
    assert run[2][9 + 1].data_ptr() == twin.weight.data_ptr() != layer.weight.data_ptr()
    assert callable(twin.plans.for_input(x))


def test_scratch_weight_is_not_used_when_autograd_keeps_the_weight(fake_gpu):
    """The shared scratch weight is overwritten by the next layer: a GEMM whose backward needs the weight
    (grad enabled, input requiring grad) gets a weight of its own."""
    layer = _layer(256, 512)
    x = torch.randn(300, 512).to(torch.bfloat16)
    w = layer.scratch_weight(x, torch.bfloat16)
    assert w is not None and w.shape == (256, 512)
    assert layer.scratch_weight(x.requires_grad_(), torch.bfloat16) is None
    with torch.no_grad():
        assert layer.scratch_weight(x, torch.bfloat16) is not None
