"""A request's ``eta`` on the compiled engine (tiny-shapes, 64 x 64): DDIM at eta 1 makes other images than at 0
(today's DDIM, also the request without eta), the same again for the same seed and others for another seed; Euler a at
eta 0 is not Euler a's default; a sampler without an eta ignores it; none of it compiles anything (eta changes the
schedule's coefficients, which the program traces). The infotext writes A1111's ``Eta DDIM`` / ``Eta`` where eta is
not the sampler's default."""

import numpy as np
import pytest

from sdxl_engine.service.delivery import deliver
from sdxl_engine.serving.apis.a1111 import generation_parameters

pytestmark = pytest.mark.engine


def gen(engine, **kw):
    from sdxl_engine.engine.validation import GenerateRequest

    return engine.generate(GenerateRequest("a red circle", **{"seed": 3, "num_inference_steps": 4, "width": 64,
                                                               "height": 64, "sampler": "DDIM", **kw}))


def parameters(result) -> dict:
    import io

    from PIL import Image

    return generation_parameters(Image.open(io.BytesIO(deliver(result, "a red circle", "None").pngs[0]))
                                 .info["parameters"])


def differ(one, other) -> bool:
    return np.abs(one.images.astype(int) - other.images).mean() > 1.0


def test_eta_moves_the_images_reproducibly_and_compiles_nothing(tiny_shapes_engine):
    plain = gen(tiny_shapes_engine)  # compiles 64 x 64 if no test did yet
    before = tiny_shapes_engine.compile_count
    zero, one, again = gen(tiny_shapes_engine, eta=0), gen(tiny_shapes_engine, eta=1.0), gen(tiny_shapes_engine, eta=1)
    other_seed = gen(tiny_shapes_engine, eta=1.0, seed=4)
    ancestral, ancestral_0 = gen(tiny_shapes_engine, sampler="Euler a"), gen(tiny_shapes_engine, sampler="Euler a",
                                                                             eta=0.0)
    euler, euler_eta = gen(tiny_shapes_engine, sampler="Euler"), gen(tiny_shapes_engine, sampler="Euler", eta=0.5)
    assert tiny_shapes_engine.compile_count == before
    assert np.array_equal(plain.images, zero.images) and np.array_equal(one.images, again.images)
    assert differ(one, plain) and differ(other_seed, one) and differ(ancestral_0, ancestral)
    assert np.array_equal(euler.images, euler_eta.images)
    assert parameters(one)["Eta DDIM"] == "1.0" and "Eta DDIM" not in parameters(zero)
    assert parameters(ancestral_0)["Eta"] == "0.0" and "Eta" not in parameters(ancestral)
    assert "Eta" not in parameters(euler_eta) and "Eta DDIM" not in parameters(plain)
