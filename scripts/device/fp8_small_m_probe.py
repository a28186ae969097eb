"""Device probe: which row-wise scaled FP8 GEMMs (``torch._scaled_mm``, the fp8_speed path) cuBLASLt refuses.

bench_nvfp4 (commit debc92c, H100, torch 2.11) saw CUBLAS_STATUS_NOT_SUPPORTED at M = 16 for K = 6912 / 12288.
Tries M x K x N with and without bias, fast accumulation on and off, and padded M, and prints what fails.
    python scripts/device/fp8_small_m_probe.py
"""
import itertools

import torch

dev = "cuda"
print(torch.cuda.get_device_name(), torch.__version__)
for (k, n) in [(6912, 2560), (12288, 3072), (2560, 6912), (3072, 12288), (4096, 4096), (16384, 3072)]:
    w8 = (torch.randn(n, k, device=dev) * 0.1).to(torch.float8_e4m3fn)
    sw = torch.rand(1, n, device=dev) + 0.5
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    fails = []
    for m, use_bias, fast in itertools.product([1, 8, 15, 16, 17, 24, 32, 48, 64, 128], [False, True], [False, True]):
        x8 = (torch.randn(m, k, device=dev)).to(torch.float8_e4m3fn)
        sx = torch.rand(m, 1, device=dev) + 0.5
        try:
            torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16,
                             bias=bias if use_bias else None, use_fast_accum=fast)
            torch.cuda.synchronize()
        except RuntimeError as exc:
            fails.append((m, use_bias, fast, str(exc).split("when calling")[0][-40:]))
    print(f"K={k} N={n}: {len(fails)} fail: {fails}", flush=True)
