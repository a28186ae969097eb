"""CUDA-graph timing and error helpers shared by the device probes."""
import torch


def capture(fn, inner):
    """A CUDA graph of ``inner`` calls of fn, after warm-up calls (compiles, autotuning) outside the capture."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    return g


def graphed(fn, inner, reps=25):
    g = capture(fn, inner)
    for _ in range(3):
        g.replay()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / inner)
    ts.sort()
    return ts[len(ts) // 2]


def rel(y, ref):
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
