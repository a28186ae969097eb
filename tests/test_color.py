import pytest
import torch

from seedvr2bw.models.seedvr2 import color


def _img(seed, n=2, h=37, w=29):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, h, w, generator=g)


def test_wavelet_decomposition_is_exact_split():
    x = _img(0)
    high, low = color.wavelet_decomposition(x)
    torch.testing.assert_close(high + low, x, atol=1e-6, rtol=0)


def test_wavelet_keeps_low_band_of_source_exactly():
    content, reference = _img(1), _img(2)
    out = color.wavelet_reconstruction(content, reference)
    content_high, _ = color.wavelet_decomposition(content)
    _, ref_low = color.wavelet_decomposition(reference)
    # out = high(content) + low(reference): the low band is the reference's.
    torch.testing.assert_close(out - content_high, ref_low, atol=1e-6, rtol=0)
    # and the same reference as content gives the content back
    torch.testing.assert_close(color.wavelet_reconstruction(content, content), content, atol=1e-6, rtol=0)


def test_wavelet_fixes_a_global_colour_shift():
    reference = _img(3)
    shifted = reference + torch.tensor([0.2, -0.1, 0.05]).reshape(1, 3, 1, 1)
    out = color.wavelet_reconstruction(shifted, reference)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)


def test_wavelet_works_on_tiny_images():
    x = _img(4, n=1, h=2, w=3)
    out = color.color_correct(x, x, "wavelet")
    assert out.shape == x.shape


def test_adain_matches_reference_statistics():
    content = _img(5) * 0.5 + 0.1
    reference = _img(6) * 0.3 + 0.4
    out = color.adain_color_fix(content, reference)
    torch.testing.assert_close(out.mean(dim=(2, 3)), reference.mean(dim=(2, 3)), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.std(dim=(2, 3), unbiased=False), reference.std(dim=(2, 3), unbiased=False),
                               atol=1e-4, rtol=0)


def test_lab_round_trip():
    x = _img(7)
    x[0, :, 0, 0] = 0.0  # black
    x[0, :, 0, 1] = 1.0  # white
    x[0, :, 0, 2] = 0.001  # linear segment of sRGB and of L*
    back = color.lab_to_rgb(color.rgb_to_lab(x))
    torch.testing.assert_close(back, x, atol=1e-5, rtol=0)


def test_lab_known_values():
    white = torch.ones(1, 3, 1, 1)
    lab = color.rgb_to_lab(white)[0, :, 0, 0]
    torch.testing.assert_close(lab, torch.tensor([100.0, 0.0, 0.0]), atol=2e-3, rtol=0)
    black = torch.zeros(1, 3, 1, 1)
    torch.testing.assert_close(color.rgb_to_lab(black)[0, :, 0, 0], torch.zeros(3), atol=1e-4, rtol=0)


def test_lab_transfer_matches_reference_lab_statistics():
    reference = _img(8) * 0.6 + 0.2
    content = (_img(9) * 0.6 + 0.2) * torch.tensor([1.0, 0.8, 0.9]).reshape(1, 3, 1, 1)
    out = color.lab_color_fix(content, reference)
    assert out.min() >= 0 and out.max() <= 1
    ol, rl = color.rgb_to_lab(out), color.rgb_to_lab(reference)
    torch.testing.assert_close(ol.mean(dim=(2, 3)), rl.mean(dim=(2, 3)), atol=0.5, rtol=0)


@pytest.mark.parametrize("mode", color.COLOR_CORRECTION_MODES)
def test_color_correct_modes_shape_range_identity(mode):
    x = _img(10, n=3)
    out = color.color_correct(x, x, mode, chunk=2)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert out.min() >= 0 and out.max() <= 1
    torch.testing.assert_close(out, x, atol=1e-4, rtol=0)


def test_color_correct_errors():
    x = _img(11)
    with pytest.raises(ValueError, match="unknown color_correction"):
        color.color_correct(x, x, "hsv")
    with pytest.raises(ValueError, match="equal shapes"):
        color.color_correct(x, x[:, :, :5], "adain")
