"""transformers picks its fast (torchvision) image processors where torchvision imports and its PIL ones where it
does not (as beside the CPU torch build here, where this test is skipped): the gateway must make the same pixels
either way, within the tolerance transformers' own slow/fast equivalence tests allow (the two resize differently)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.images import picture

try:
    import torchvision  # noqa: F401
except Exception as exc:  # (the registry's torchvision fails to import beside the CPU torch build, not only missing)
    pytest.skip(f"torchvision does not import here ({type(exc).__name__}): only the PIL processors run",
                allow_module_level=True)


@pytest.mark.parametrize("family", ["llava_dir", "llava_next_dir", "qwen2_vl_dir", "gemma3_multimodal_dir"])
def test_fast_and_pil_processors_make_the_same_pixels(family, request):
    from transformers import AutoImageProcessor

    model_dir = request.getfixturevalue(family)
    images = [picture(1), picture(2, (90, 40)), picture(3, (100, 100))]
    pil = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    fast = AutoImageProcessor.from_pretrained(model_dir, backend="torchvision")
    assert type(pil).__name__.endswith("Pil") and not type(fast).__name__.endswith("Pil")
    slow_out, fast_out = pil(images=images, return_tensors="np"), fast(images=images, return_tensors="np")
    assert set(slow_out) == set(fast_out)
    for key in slow_out:
        a, b = np.asarray(slow_out[key]), np.asarray(fast_out[key])
        assert a.shape == b.shape, key
        if key != "pixel_values":  # grids and sizes: exactly
            assert np.array_equal(a, b), key
            continue
        assert np.abs(a - b).max() <= 1e-1 and np.abs(a - b).mean() <= 5e-3, key
