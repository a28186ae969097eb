"""A worker of models/seedvr2/video/workers.py for the tests: its "model" doubles the frame size (loading it is
logged to --loads), ``params``: ``slow_s`` per chunk, ``fail_rank`` raises there, ``unfit_rank``'s device cannot
run the job (its ``fits`` says why)."""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pack_import import import_pack  # noqa: E402

import_pack()
import torch  # noqa: E402
from seedvr2bw.models.seedvr2.video.workers import serve  # noqa: E402


def double(frames):
    up = frames.repeat(2, axis=1).repeat(2, axis=2)
    return up * 0.95 + 0.05 * up.mean(axis=0, keepdims=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loads", required=True)
    ap.add_argument("--pool-store", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--parallel", default="chunks")
    ap.add_argument("--calls", default="", help="each rank appends the frames of every chunk it upscaled")
    a = ap.parse_args()
    with open(a.loads, "a") as f:      # the model load: once per worker, whatever the number of jobs
        f.write(f"{a.rank} {torch.get_num_threads()}\n")

    def make_upscaler(params, group):
        def up(frames):   # slow_s: every rank takes chunks (one rank could otherwise take them all)
            time.sleep(params.get("slow_s", 0.0))
            if params.get("fail_rank") == a.rank:
                raise ValueError("this worker was told to fail")
            if a.calls:
                with open(a.calls, "a") as f:
                    f.write(f"{a.rank} {len(frames)} {group is not None}\n")
            return double(frames)
        up.fits = lambda frames, h, w: (f"cpu of rank {a.rank}: too small for {frames} frames"
                                        if params.get("unfit_rank") == a.rank else None)
        return up

    serve(a.pool_store, a.rank, a.world, a.device, make_upscaler, parallel=a.parallel)


if __name__ == "__main__":
    main()
