"""The PNGs a request hands back carry AUTOMATIC1111's ``parameters`` text, field by field (serving/delivery.py).

A1111's infotext (modules/processing.py ``create_infotext``): line 1 the prompt, line 2
``Negative prompt: ...`` only when there is one, last line ``key: value`` pairs joined by ", "; of
A1111's keys this engine writes Steps, Sampler, CFG scale, Seed, Size (WIDTHxHEIGHT), Model, and Style
for a style preset, in that order. The expected texts are written out here, not built with
images.a1111_parameters, so a mistake there shows too.
"""

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.engine.contract import GenerateResult
from sdxl_engine.engine.validation import GenerateRequest
from sdxl_engine.service.delivery import deliver
from sdxl_engine.service.styles import NO_STYLE


def result(request: GenerateRequest, seeds: list[int]) -> GenerateResult:
    """A result as the engine returns it, with distinct known pixels per image."""
    rng = np.random.default_rng(seeds[0])
    images = rng.integers(0, 256, (len(seeds), request.height, request.width, 3), dtype=np.uint8)
    return GenerateResult(images=images, seeds=seeds, request=request, timings={"latency": 0.5},
                          warnings=[], device_count=2, device_summary="2 × cpu", model="my-sdxl")


@pytest.mark.parametrize("request_, seeds, style, expected", [
    (GenerateRequest("a red circle, large", "blurry, green", 42, 6.5, 12, 72, 56, "DPM++ 2M Karras"), [42, 43],
     "Pixel art",
     "a red circle, large\nNegative prompt: blurry, green\nSteps: 12, Sampler: DPM++ 2M Karras, CFG scale: 6.5, "
     "Seed: {seed}, Size: 72x56, Model: my-sdxl, Style: Pixel art"),
    (GenerateRequest("a red circle", "", 2**32 - 1, 5.0, 8, 56, 72, "Euler"), [2**32 - 1, 0], NO_STYLE,
     "a red circle\nSteps: 8, Sampler: Euler, CFG scale: 5, Seed: {seed}, Size: 56x72, Model: my-sdxl"),
], ids=["negative-style-wide", "no-negative-tall"])
def test_every_png_carries_the_a1111_parameters_of_its_own_seed(tmp_path, request_, seeds, style, expected):
    out = deliver(result(request_, seeds), request_.prompt, style, tmp_path / "files", str(tmp_path / "saved"))
    made = result(request_, seeds).images
    assert len(out.paths) == len(out.info["saved"]) == len(seeds)
    for i, seed in enumerate(seeds):
        for path in (out.paths[i], tmp_path / "saved" / out.info["saved"][i]):
            with Image.open(path) as image:
                assert image.format == "PNG" and image.size == (request_.width, request_.height)
                assert image.text["parameters"] == expected.format(seed=seed)
                np.testing.assert_array_equal(np.asarray(image.convert("RGB")), made[i])
    assert {k: out.info[k] for k in ("prompt", "negative_prompt", "guidance_scale", "num_inference_steps", "sampler",
                                     "width", "height", "model", "style", "seeds")} == {
        "prompt": request_.prompt, "negative_prompt": request_.negative_prompt,
        "guidance_scale": request_.guidance_scale, "num_inference_steps": request_.num_inference_steps,
        "sampler": request_.sampler, "width": request_.width, "height": request_.height, "model": "my-sdxl",
        "style": style, "seeds": seeds}
