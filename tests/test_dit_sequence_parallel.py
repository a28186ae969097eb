"""Sequence-parallel DiT forward (models/seedvr2/dit/sequence_parallel.py) on 2 and 3 CPU processes over gloo: the
output of the golden tiny 3B and 7B equals the single-process output within fp32 rounding on every rank, all ranks
stop together, and the window partition is balanced and covers every token once."""
from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA
from gloo_ranks import run_ranks
from seedvr2bw.models.seedvr2.dit import load_dit
from seedvr2bw.models.seedvr2.dit.sequence_parallel import balanced_runs, local_layout, split_layout
from seedvr2bw.models.seedvr2.dit.window import build_joint_layout

GOLDEN = DATA / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
VARIANTS = ("3b", "7b")
CASES = ("image", "video", "batch")
METHODS = ("720pwin_by_size_bysize", "720pswin_by_size_bysize")
# fp32 rounding: the text mean sums its copies per rank first, and matmuls over fewer rows block differently
TOL = 2e-6


def _model(variant):
    return load_dit(GOLDEN / MANIFEST["dit"]["tiny_models"][variant]["weights_file"], attention_backend="sdpa")


def _inputs(case):
    """(vid, txt, vid_shape, txt_shape, timestep): the golden cases, and a batch of two clips with their own texts
    and timesteps (a rank then holds windows of both samples)."""
    if case == "batch":
        g = torch.Generator().manual_seed(3)
        shapes = [(1, 36, 52), (5, 20, 28)]
        vid = torch.cat([torch.randn(t * h * w, 33, generator=g) for t, h, w in shapes])
        txt = torch.randn(3 + 5, 24, generator=g)
        return vid, txt, torch.tensor(shapes), torch.tensor([[3], [5]]), torch.tensor([1000.0, 400.0])
    inp = load_file(GOLDEN / MANIFEST["dit"]["cases"][case]["inputs_file"])
    return (inp["vid"].reshape(-1, inp["vid"].shape[-1]), inp["txt"], inp["vid_shape"], inp["txt_shape"],
            inp["timestep"])


def _on_rank(rank, world):
    from seedvr2bw.models.seedvr2.dit import DiTInterrupted
    from seedvr2bw.models.seedvr2.dit.sequence_parallel import SequenceParallelDiT
    results = {}
    for variant in VARIANTS:
        model = _model(variant)
        sp = SequenceParallelDiT(model)
        for case in CASES:
            results[f"{variant}.{case}"] = sp(*_inputs(case))
        # a wrapper made later (the pipeline makes one per run) finds the shape's plan in the model's cache
        vid, _, vid_shape, txt_shape, _ = _inputs(CASES[0])
        pt, ph, pw = model.config.patch_size
        grids = [(t // pt, h // ph, w // pw) for t, h, w in vid_shape.tolist()]
        lens = [int(n[0]) for n in txt_shape.tolist()]
        again = SequenceParallelDiT(model)
        shared = again.plan(grids, lens, vid.device) is sp.plan(grids, lens, vid.device)
        results[f"{variant}.plan_shared"] = torch.tensor([shared])
        results[f"{variant}.again"] = again(*_inputs(CASES[0]))
        try:  # only the last rank asks to stop
            sp(*_inputs("video"), should_stop=lambda: rank == world - 1)
            stopped = False
        except DiTInterrupted:
            stopped = True
        results[f"{variant}.stopped"] = torch.tensor([stopped])
    return results


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory):
    """{rank: saved results} of one spawned gloo group of ``world`` CPU processes."""
    world = request.param
    return world, run_ranks(_on_rank, world, tmp_path_factory.mktemp(f"sp{world}"))


@pytest.fixture(scope="module")
def single():
    with torch.no_grad():
        return {f"{v}.{c}": _model(v)(*_inputs(c)) for v in VARIANTS for c in CASES}


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_later_wrapper_reuses_the_plan_and_gives_the_same_output(ranks, variant):
    world, results = ranks
    for r in range(world):
        assert bool(results[r][f"{variant}.plan_shared"])
        assert torch.equal(results[r][f"{variant}.again"], results[r][f"{variant}.{CASES[0]}"])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_sequence_parallel_equals_single_process(ranks, single, variant, case):
    world, results = ranks
    ref = single[f"{variant}.{case}"]
    out = results[0][f"{variant}.{case}"]
    for r in range(1, world):  # every rank returns the same full output
        assert torch.equal(results[r][f"{variant}.{case}"], out)
    diff = float((out - ref).abs().max())
    rel = diff / float(ref.abs().max())
    print(f"{world} ranks, {variant}/{case}: max |diff| {diff:.2e} (relative to max |out| {rel:.2e})")
    assert out.shape == ref.shape
    assert rel <= TOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_ranks_stop_together(ranks, variant):
    world, results = ranks
    assert all(bool(results[r][f"{variant}.stopped"]) for r in range(world))


def _grid_cases():
    return [([(1, 18, 26)], [3]), ([(5, 23, 41)], [3]), ([(1, 45, 80)], [58]), ([(6, 68, 120)], [58]),
            ([(1, 18, 26), (5, 10, 14)], [3, 5])]


@pytest.mark.parametrize("grids,txt_lens", _grid_cases())
@pytest.mark.parametrize("method", METHODS)
def test_partition_is_balanced_and_covers_every_token_once(grids, txt_lens, method):
    lay = build_joint_layout(grids, txt_lens, method, (4, 3, 3), "cpu")
    n_vid = sum(t * h * w for t, h, w in grids)
    windows = [(b, w) for b, wins in enumerate(lay.windows) for w in wins]
    sizes = [(w[0][1] - w[0][0]) * (w[1][1] - w[1][0]) * (w[2][1] - w[2][0]) for _, w in windows]
    for world in range(1, min(len(windows), 8) + 1):
        shares = split_layout(lay, txt_lens, world)
        assert len(shares) == world
        ids = torch.cat([s.ids for s in shares])
        assert torch.equal(ids.sort().values, torch.arange(n_vid)), "every token exactly once"
        held = [(b, w) for s in shares for b, wins in enumerate(s.windows) for w in wins]
        assert sorted(held) == sorted(windows), "whole windows, each on one rank"
        loads = [s.ids.numel() for s in shares]
        assert all(n > 0 for n in loads)
        assert [sum(s.vid_lens) for s in shares] == loads
        assert max(loads) <= -(-n_vid // world) + max(sizes), loads
        assert max(loads) == max(sum(sizes[i] for i in r) for r in balanced_runs(sizes, world))


def _best_max(sizes, parts):
    """The smallest largest run over all cuts into ``parts`` non-empty contiguous runs (brute force)."""
    best = None
    for cuts in itertools.combinations(range(1, len(sizes)), parts - 1):
        edges = (0,) + cuts + (len(sizes),)
        worst = max(sum(sizes[a:b]) for a, b in zip(edges, edges[1:]))
        best = worst if best is None else min(best, worst)
    return best


def test_balanced_runs_are_optimal_contiguous_cuts():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(1, 10, (1,), generator=g))
        sizes = torch.randint(1, 50, (n,), generator=g).tolist()
        for parts in range(1, n + 1):
            runs = balanced_runs(sizes, parts)
            assert len(runs) == parts and all(len(r) > 0 for r in runs)
            assert [i for r in runs for i in r] == list(range(n))
            assert max(sum(sizes[i] for i in r) for r in runs) == _best_max(sizes, parts)
    with pytest.raises(ValueError, match="at least one window"):
        balanced_runs([5, 5], 3)


@pytest.mark.parametrize("method", METHODS)
def test_one_rank_layout_is_the_global_layout(method):
    """With one rank the local layout is the model's own, field for field."""
    grids, txt_lens = [(1, 18, 26), (5, 10, 14)], [3, 5]
    lay = build_joint_layout(grids, txt_lens, method, (4, 3, 3), "cpu")
    (share,) = split_layout(lay, txt_lens, 1)
    assert torch.equal(share.ids, lay.gather[lay.gather < lay.vid_pos.numel()])
    # the global layout keeps tokens in input order; the local one window by window: compare through the ids
    loc = local_layout(lay, share, txt_lens, "cpu")
    assert torch.equal(loc.vid_pos, lay.vid_pos[share.ids])
    for name in ("coords", "sizes", "txt_offset"):
        assert torch.equal(getattr(loc, name), getattr(lay, name)[share.ids]), name
    text = [torch.full((lay.total,), -1).index_put_((x.txt_slots,), x.txt_src) for x in (loc, lay)]
    assert torch.equal(*text), "the same text token in every text slot"
    assert all(torch.equal(a, b) for a, b in zip(loc.txt_pos, lay.txt_pos))
    assert loc.total == lay.total and loc.plan.q_lens == lay.plan.q_lens and loc.windows == lay.windows
