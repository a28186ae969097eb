"""One training micro-step (forward, loss, LoRA gradients) replayed as a CUDA graph.

Why: a FLUX LoRA step dispatches ~27k aten ops (57 blocks, 304 LoRA'd Linears, checkpoint recompute; measured by
``bench_flux_lora.py --host-ops``); the host needs about as long to launch them as an H100 needs to run them at
1024² and much longer at 512² (eager 512² steps took 0.58 s), so eager steps are host-bound. A captured graph
launches them all in one call (512²: 0.157 s per step).

How: per input shape, one eager warm-up run on a side stream (compiles, autotunes, allocates cuBLAS workspaces;
its loss and gradients are that step's result), then a capture of ``loss = fn(*inputs)`` and
``torch.autograd.grad(loss, params)`` into static tensors. Later steps of that shape copy their inputs into the
static inputs and replay. The LoRA weights are read in place, so optimizer updates between replays are seen.
All graphs share one memory pool: they run one after another on one stream, and their outputs stay alive.

Not captured: the optimizer, clipping and the LR schedule (any optimizer works, the LR is never baked in).
Anything that cannot be captured (a host sync or host-to-device copy inside the model) makes the capture fail;
the trainer then logs why and runs eagerly from then on.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class GraphedLossAndGrads:
    """``(loss, grads) = self(*inputs)`` where ``fn(*inputs)`` computes the scalar loss and the gradients
    (``None`` for a parameter the loss does not use). Inputs: CUDA tensors. ``max_graphs``: shapes captured
    at most (later shapes run eagerly). Returned tensors are the graph's static outputs: read or copy them
    before the next call."""

    def __init__(self, fn, device, max_graphs: int = 4):
        self.fn = fn
        self.device = torch.device(device)
        self.max_graphs = int(max_graphs)
        self.graphs = {}     # shape key -> (graph, static inputs, static loss, static grads)
        self.pool = None
        self.stream = None
        self.failed = None   # why capturing failed (then every call runs eagerly)
        self._eager_shapes_logged = set()

    @staticmethod
    def _key(inputs):
        return tuple((tuple(t.shape), t.dtype) for t in inputs)

    def __call__(self, *inputs):
        key = self._key(inputs)
        entry = self.graphs.get(key)
        if entry is not None:
            graph, static_in, loss, grads = entry
            for s, t in zip(static_in, inputs):
                s.copy_(t, non_blocking=True)
            graph.replay()
            return loss, grads
        if self.failed is not None or len(self.graphs) >= self.max_graphs:
            if self.failed is None and key not in self._eager_shapes_logged:
                self._eager_shapes_logged.add(key)
                log.info("[FluxLoraTrain] CUDA graphs: %d shapes captured already; shape %s runs eagerly",
                         self.max_graphs, [k[0] for k in key])
            return self.fn(*inputs)
        return self._capture(key, inputs)

    def _capture(self, key, inputs):
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
            self.pool = torch.cuda.graph_pool_handle()
        cur = torch.cuda.current_stream(self.device)
        static_in = [t.detach().clone() for t in inputs]
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            loss, grads = self.fn(*static_in)  # warm-up on the capture stream: this step's result
        cur.wait_stream(self.stream)
        # the warm-up's cached activation memory is not reusable by the graph's private pool: give it back first
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                s_loss, s_grads = self.fn(*static_in)
        except Exception as exc:  # noqa: BLE001 - a host sync / uncapturable op somewhere in the model
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning("[FluxLoraTrain] CUDA graph capture failed (%s); training continues without CUDA graphs "
                        "(set cuda_graph off / SEEDVR2BW_TRAIN_CUDA_GRAPH=0 to skip the attempt)", self.failed)
            graph = None   # drop the half-captured graph before freeing its memory
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            return loss, grads
        self.graphs[key] = (graph, static_in, s_loss, s_grads)
        log.info("[FluxLoraTrain] CUDA graph captured for input shapes %s (%d so far)", [k[0] for k in key],
                 len(self.graphs))
        return loss, grads

    def close(self):
        self.graphs.clear()
        self.pool = None
