"""Training controls on the tiny FLUX (CPU): caption dropout with cached conditioning, EMA of the LoRA, validation
loss with "keep best", regularisation images, and resume after a stop at any step with all of their state."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_training_helpers import FakeCLIP, FakeVAE, make_image_folder, require_comfy, tiny_flux_patcher  # noqa: E402


@pytest.fixture(scope="module")
def T():
    torch.set_num_threads(1)
    require_comfy()
    import seedvr2bw.training as T
    return T


def dataset(T, tmp_path, name="ds", n=3, caption=None):
    folder = make_image_folder(tmp_path / name, n=n)
    if caption is not None:
        for i in range(n):
            (folder / f"img{i}.txt").write_text(f"{caption} {i}")
    return T.encode_dataset(T.DatasetSpec(folder=str(folder), resolution=64), FakeVAE(), FakeCLIP(),
                            cache_dir=str(tmp_path / "cache"))


def cfg(T, tmp_path, **kw):
    base = dict(rank=4, alpha=4, steps=4, learning_rate=3e-3, compute_dtype="fp32", output_dir=str(tmp_path / "out"),
                output_name="c", seed=7, save_dtype="fp32")
    base.update(kw)
    return T.TrainConfig(**base)


def trainer(T, mp, c, ds, **kw):
    return T.FluxLoraTrainer(mp.model.diffusion_model, c, ds, latent_format=mp.model.latent_format, device="cpu", **kw)


def weights(tr):
    return {k: v.detach().clone() for k, v in tr.network.state_dict().items()}


def load(path):
    from safetensors.torch import load_file
    return load_file(str(path))


class Recorder:
    """Stands in for the trainer's forward and records the text conditioning of every call."""

    def __init__(self, fwd):
        self.fwd, self.contexts = fwd, []

    def __call__(self, x_t, sigma, context, y, guidance=None):
        self.contexts.append(context.detach().clone())
        return self.fwd(x_t, sigma, context, y, guidance)

    def __getattr__(self, name):
        return getattr(self.fwd, name)


# ---------------------------------------------------------------- caption dropout
def test_caption_dropout_one_trains_on_the_empty_caption_only(T, tmp_path):
    a = dataset(T, tmp_path, "a")
    b = dataset(T, tmp_path, "b", caption="something else entirely")
    assert "" in a.conds   # encoded once with the dataset, cached with it
    mp = tiny_flux_patcher()
    out = {}
    for name, ds, p in (("a1", a, 1.0), ("b1", b, 1.0), ("a0", a, 0.0)):
        tr = trainer(T, mp, cfg(T, tmp_path, output_name=name, caption_dropout=p, batch_size=2), ds)
        tr.forward = rec = Recorder(tr.forward)
        tr.run()
        out[name] = weights(tr)
        tr.close()
        empty = [torch.equal(c, ds.conds[""][None].expand_as(c)) for c in rec.contexts]
        assert len(empty) == 4 and all(empty) == (p == 1.0) and any(empty) == (p == 1.0), (name, empty)
    # with every caption dropped the captions cannot matter: other captions, the same LoRA to the bit
    assert all(torch.equal(out["a1"][k], out["b1"][k]) for k in out["a1"])
    assert not all(torch.equal(out["a1"][k], out["a0"][k]) for k in out["a1"])


def test_caption_dropout_share_and_bad_value(T, tmp_path):
    ds = dataset(T, tmp_path)
    mp = tiny_flux_patcher()
    tr = trainer(T, mp, cfg(T, tmp_path, caption_dropout=0.3), ds)
    drops = [d for step in range(200) for d in (tr.dropped(step % 4, 8))]
    tr.close()
    assert 0.25 < sum(drops) / len(drops) < 0.35
    with pytest.raises(ValueError, match="caption_dropout must be between 0 and 1.*Fix"):
        cfg(T, tmp_path, caption_dropout=1.5).validate()


# ---------------------------------------------------------------- EMA
def test_ema_equals_a_reference_ema_of_the_saved_raw_weights(T, tmp_path):
    ds = dataset(T, tmp_path)
    mp = tiny_flux_patcher()
    decay = 0.8
    tr = trainer(T, mp, cfg(T, tmp_path, steps=5, ema_decay=decay, save_every=1, keep_last=100,
                            learning_rate=2e-2), ds)
    start = {k.removeprefix("loras."): v.clone() for k, v in weights(tr).items()}
    final = tr.run()
    tr.close()
    out = tmp_path / "out"
    ref = {k: v.float().clone() for k, v in start.items()}
    for step in range(1, 6):
        raw = load(final if step == 5 else out / f"c-step{step:08d}.safetensors")   # the raw weights of that step
        for k in ref:
            ref[k].mul_(decay).add_(raw[k], alpha=1 - decay)
        ema = load(out / ("c_ema.safetensors" if step == 5 else f"c-step{step:08d}_ema.safetensors"))
        for k in ref:
            assert torch.allclose(ema[k], ref[k], rtol=1e-6, atol=1e-8), (step, k)
        assert not all(torch.equal(ema[k], raw[k]) for k in ref)
    with pytest.raises(ValueError, match="ema_decay must be 0.*Fix"):
        cfg(T, tmp_path, ema_decay=1.0).validate()


# ---------------------------------------------------------------- validation
def test_validation_is_deterministic_and_keep_best_keeps_the_lowest(T, tmp_path):
    ds = dataset(T, tmp_path, n=4)
    mp = tiny_flux_patcher()
    runs = []
    for name in ("v1", "v2"):
        c = cfg(T, tmp_path, output_name=name, steps=6, validation_share=0.25, validation_every=1, keep_best=True,
                save_every=1, keep_last=100, learning_rate=0.5)   # this rate overshoots: the best is not the last
        tr = trainer(T, mp, c, ds)
        assert len(tr.data) == 3   # one of four images held out
        tr.run()
        runs.append((list(tr.best.history), tr.best.best))
        tr.close()
    assert runs[0] == runs[1]   # to the bit, run after run
    history, best = runs[0]
    assert [s for s, _ in history] == list(range(1, 7))
    step = min(history, key=lambda h: h[1])[0]
    assert best == (step, min(v for _, v in history)) and step < 6, history
    out = tmp_path / "out"
    kept = load(out / "v1-best.safetensors")
    raw = load(out / "v1.safetensors" if step == 6 else out / f"v1-step{step:08d}.safetensors")
    assert all(torch.equal(kept[k], raw[k]) for k in raw)
    from safetensors import safe_open
    with safe_open(str(out / "v1-best.safetensors"), "pt") as f:
        assert f.metadata()["ss_best_step"] == str(step)


def test_validation_dataset_input_and_best_tracker(T, tmp_path):
    from seedvr2bw.training.validation import BestTracker, holdout_indices
    bt = BestTracker()
    assert [bt.record(s, v) for s, v in ((1, 0.5), (2, 0.4), (3, 0.45), (4, 0.4), (5, 0.3))] == \
        [True, True, False, False, True]
    assert bt.best == (5, 0.3)
    assert holdout_indices(10, 0.2, 1) == holdout_indices(10, 0.2, 1) and len(holdout_indices(10, 0.2, 1)) == 2
    with pytest.raises(ValueError, match="leaves none to train on.*Fix"):
        holdout_indices(1, 0.5, 1)
    ds, val = dataset(T, tmp_path, "t", n=2), dataset(T, tmp_path, "v", n=1, caption="held out")
    mp = tiny_flux_patcher()
    with pytest.raises(ValueError, match="keep_best needs a validation loss.*Fix: set validation_share"):
        trainer(T, mp, cfg(T, tmp_path, keep_best=True), ds)
    tr = trainer(T, mp, cfg(T, tmp_path, steps=2), ds, validation=val)
    first = tr.validation_loss()
    assert first == tr.validation_loss() and len(tr.data) == 2
    tr.run()
    assert len(tr.best.history) == 1 and tr.best.history[0][0] == 2   # validation_every 0: at the end
    tr.close()


def test_loss_plot_with_validation():
    from seedvr2bw.training.plot import VALIDATION_COLOUR, render_loss_curve
    img = render_loss_curve([1.0, 0.8, 0.9, 0.5, 0.4], validation=[(2, 0.85), (4, 0.6)])
    px = (img[0] * 255).round().to(torch.int16)
    assert (px == torch.tensor(VALIDATION_COLOUR, dtype=torch.int16)).all(-1).sum() > 20


# ---------------------------------------------------------------- regularisation images
def test_regularisation_images_at_their_own_weight(T, tmp_path):
    ds, reg = dataset(T, tmp_path, "t", n=2), dataset(T, tmp_path, "r", n=2, caption="a photo of a dog")
    mp = tiny_flux_patcher()
    first = {}
    for w in (0.0, 1.0, 2.0, 3.0):
        tr = trainer(T, mp, cfg(T, tmp_path, steps=1, reg_weight=w), ds, regularization=reg)
        tr.forward = rec = Recorder(tr.forward)
        first[w] = tr.train_step()
        tr.close()
        reg_ctx = [any(torch.equal(c[0], reg.conds[k]) for k in reg.conds) for c in rec.contexts]
        assert reg_ctx == ([False] if w == 0 else [False, True])   # a training batch, then a regularisation batch
    reg_loss = first[1.0] - first[0.0]
    assert reg_loss > 0
    assert first[2.0] == pytest.approx(first[0.0] + 2 * reg_loss, rel=1e-5)
    assert first[3.0] == pytest.approx(first[0.0] + 3 * reg_loss, rel=1e-5)


# ---------------------------------------------------------------- resume
@pytest.mark.parametrize("stop_at", [1, 2, 3, 4])
def test_resume_after_a_stop_at_any_step_equals_the_uninterrupted_run(T, tmp_path, stop_at):
    ds, reg = dataset(T, tmp_path, "t", n=4), dataset(T, tmp_path, "r", n=2, caption="a photo of a dog")
    mp = tiny_flux_patcher()
    kw = dict(steps=5, ema_decay=0.7, validation_share=0.25, validation_every=2, keep_best=True, caption_dropout=0.5,
              reg_weight=0.5, grad_accum=2, lr_scheduler="cosine", learning_rate=2e-2)

    def result(tr, name):
        out = tmp_path / "out"
        return (weights(tr), list(tr.losses), list(tr.best.history), load(out / f"{name}_ema.safetensors"),
                load(out / f"{name}-best.safetensors"))

    full = trainer(T, mp, cfg(T, tmp_path, output_name="full", **kw), ds, regularization=reg)
    full.run()
    ref = result(full, "full")
    full.close()

    class Stop(BaseException):
        pass
    calls = [0]

    def stop():
        calls[0] += 1
        if calls[0] == stop_at + 1:
            raise Stop()
    part = trainer(T, mp, cfg(T, tmp_path, output_name="part", **kw), ds, regularization=reg)
    with pytest.raises(Stop):
        part.run(check_interrupt=stop)
    part.close()
    torch.manual_seed(1234)   # disturb the global RNG: resume must restore it
    res = trainer(T, mp, cfg(T, tmp_path, output_name="part", **kw), ds, regularization=reg)
    res.load_state()
    assert res.step == stop_at
    res.run()
    got = result(res, "part")
    res.close()
    for k in ref[0]:
        assert torch.equal(ref[0][k], got[0][k]), k
    assert got[1] == ref[1] and got[2] == ref[2]
    for a, b in ((ref[3], got[3]), (ref[4], got[4])):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_state_without_ema(T, tmp_path):
    ds = dataset(T, tmp_path)
    mp = tiny_flux_patcher()
    tr = trainer(T, mp, cfg(T, tmp_path, steps=1), ds)
    tr.run()
    tr.close()
    tr = trainer(T, mp, cfg(T, tmp_path, steps=2, ema_decay=0.9), ds)
    with pytest.raises(ValueError, match="ema_decay=0.*Fix"):
        tr.load_state()
    tr.close()
