"""fp32 parity of the SeedVR2 DiT (3B and 7B tiny models) with the official implementation.

Golden vectors: tests/data/golden (see manifest.json, ``dit_call``). The reference ran in fp32 with the
bf16 cast of q/k/v disabled; rel-L2 <= 1e-5 on ``out`` and on every stored intermediate.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA
from seedvr2bw.models.seedvr2.dit import config_from_reference_kwargs, load_dit

GOLDEN = DATA / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
TOL = 1e-5


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def _run(model, case: str, debug=None):
    inp = load_file(GOLDEN / MANIFEST["dit"]["cases"][case]["inputs_file"])
    T, H, W, C = inp["vid"].shape
    with torch.no_grad():
        out = model(inp["vid"].reshape(-1, C), inp["txt"], inp["vid_shape"], inp["txt_shape"], inp["timestep"], debug=debug)
    return out.reshape(T, H, W, -1)


@pytest.fixture(scope="module", params=["3b", "7b"])
def variant(request):
    return request.param


def _model(variant, backend):
    tiny = MANIFEST["dit"]["tiny_models"][variant]
    return load_dit(GOLDEN / tiny["weights_file"], attention_backend=backend)


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("case", ["image", "video"])
def test_out_parity(variant, case, backend):
    model = _model(variant, backend)
    ref = load_file(GOLDEN / MANIFEST["dit"]["tiny_models"][variant]["results"][case]["outputs_file"])
    out = _run(model, case)
    err = rel_l2(out, ref["out"])
    print(f"{variant}/{case}/{backend}: out rel-L2 {err:.3e}")
    assert out.dtype == torch.float32
    assert err <= TOL, f"{variant}/{case}: out rel-L2 {err:.3e} > {TOL}"


@pytest.mark.parametrize("case", ["image", "video"])
def test_intermediates(variant, case):
    tiny = MANIFEST["dit"]["tiny_models"][variant]
    keys = tiny["results"][case]["intermediate_keys"]
    if not keys:  # the manifest lists intermediates for the image cases only; then only `out` is compared
        assert case == "video", f"the golden {case} case should store intermediates"
        return
    ref = load_file(GOLDEN / tiny["results"][case]["outputs_file"])
    dbg = {}
    _run(_model(variant, "sdpa"), case, debug=dbg)
    for key in keys:
        name = key[len("inter."):]
        assert name in dbg, f"intermediate {name} not captured (have {sorted(dbg)})"
        got = dbg[name].reshape(ref[key].shape)
        err = rel_l2(got, ref[key])
        print(f"{variant}/{case}: {name} rel-L2 {err:.3e}")
        assert err <= TOL, f"{variant}/{case}: {name} rel-L2 {err:.3e} > {TOL}"


def test_config_from_manifest_matches_detection(variant):
    """The config derived from tensor shapes equals the one from the reference constructor kwargs."""
    tiny = MANIFEST["dit"]["tiny_models"][variant]
    from_kwargs = config_from_reference_kwargs(tiny["constructor_kwargs"])
    loaded = _model(variant, "sdpa")
    assert loaded.config == from_kwargs
    assert sum(p.numel() for p in loaded.parameters()) == tiny["num_parameters"]


def test_windows_match_manifest():
    from seedvr2bw.models.seedvr2.dit.window import shifted_windows_720p, windows_720p

    for case, info in MANIFEST["dit"]["cases"].items():
        grid = info["patched_grid"]
        wins = next(v for k, v in info.items() if k.startswith("attention_windows"))
        for fn, key in ((windows_720p, "even_blocks_unshifted(720pwin_by_size_bysize)"),
                        (shifted_windows_720p, "odd_blocks_shifted(720pswin_by_size_bysize)")):
            got = fn(grid, (4, 3, 3))
            exp = wins[key]
            assert len(got) == exp["count"], (case, key)
            assert sorted({w[0] for w in got}) == [tuple(r) for r in exp["t_ranges"]]
            assert sorted({w[1] for w in got}) == [tuple(r) for r in exp["h_ranges"]]
            assert sorted({w[2] for w in got}) == [tuple(r) for r in exp["w_ranges"]]


def test_spec_window_examples():
    from seedvr2bw.models.seedvr2.dit.window import shifted_windows_720p, windows_720p

    w = windows_720p((1, 45, 80), (4, 3, 3))
    assert len(w) == 9 and w[0] == ((0, 1), (0, 15), (0, 27))


def test_batch_of_two_equals_two_singles(variant):
    """Packed batches: each sample's output equals running it alone (windows, text mean, ada per sample)."""
    model = _model(variant, "sdpa")
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 8, 12), (5, 6, 10)]
    vids = [torch.randn(t * h * w, 33, generator=g) for t, h, w in shapes]
    txts = [torch.randn(n, 24, generator=g) for n in (3, 5)]
    ts = torch.tensor([1000.0, 400.0])
    with torch.no_grad():
        both = model(torch.cat(vids), torch.cat(txts), torch.tensor(shapes), torch.tensor([[3], [5]]), ts)
        singles = [model(v, x, torch.tensor([s]), torch.tensor([[x.shape[0]]]), ts[i:i + 1])
                   for i, (v, x, s) in enumerate(zip(vids, txts, shapes))]
    assert rel_l2(both, torch.cat(singles)) < 1e-5


def test_should_stop_interrupts(variant):
    from seedvr2bw.models.seedvr2.dit import DiTInterrupted

    model = _model(variant, "sdpa")
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 1

    with pytest.raises(DiTInterrupted):
        _run_stop(model, stop)
    assert len(calls) == 2

    class Boom(Exception):
        pass

    def raise_it():
        raise Boom()

    with pytest.raises(Boom):
        _run_stop(model, raise_it)


def _run_stop(model, fn):
    inp = load_file(GOLDEN / "dit_case_image_inputs.safetensors")
    with torch.no_grad():
        model(inp["vid"].reshape(-1, 33), inp["txt"], inp["vid_shape"], inp["txt_shape"], inp["timestep"], should_stop=fn)


def test_block_runner_is_used(variant):
    model = _model(variant, "sdpa")
    seen = []

    class Spy:
        def iterate(self, blocks):
            for b in blocks:
                seen.append(b.index)
                yield b

    model.block_runner = Spy()
    _run(model, "image")
    assert seen == list(range(model.config.num_layers))
    assert isinstance(model.blocks, torch.nn.ModuleList)


def test_pack_equals_gather():
    """The scatter packing used on the hot path equals the plain gather of the joint layout."""
    from seedvr2bw.models.seedvr2.dit.window import build_joint_layout

    grids, lens = [(5, 23, 41), (1, 18, 26)], [3, 7]
    nv = sum(t * h * w for t, h, w in grids)
    vid, txt = torch.randn(nv, 3, 4), torch.randn(sum(lens), 3, 4)
    for method in ("720pwin_by_size_bysize", "720pswin_by_size_bysize"):
        lay = build_joint_layout(grids, lens, method, (4, 3, 3), "cpu")
        assert torch.equal(lay.pack(vid, txt), torch.cat([vid, txt])[lay.gather])
        assert torch.equal(lay.pack(vid, txt)[lay.vid_pos], vid)
        assert lay.total == int(lay.plan.cu_seqlens_q[-1])


def test_rope_constants_equal_checkpoint_buffers(variant):
    """The model builds its RoPE tables from the formula; the golden checkpoint buffers hold exactly that."""
    tiny = MANIFEST["dit"]["tiny_models"][variant]
    sd = load_file(GOLDEN / tiny["weights_file"])
    model = _model(variant, "sdpa")
    for key, value in sd.items():
        if key.endswith("rope.rope.freqs"):
            assert torch.equal(model.rope_freqs(), value), key
