"""Single files and swapped parts against diffusers' PyTorch pipelines on the same latents.

``tests/fixtures/tiny-single`` (``python -m tools.make_fixtures single``, tests/fixtures/README.md): tiny-pt
written as an SDXL single file in the original sgm layout (float16), a UNet of tiny-pt's config in diffusers
layout (bfloat16) and a VAE in LDM layout (float32), each loaded by diffusers with no key warning; the
reference images are ``StableDiffusionXLPipeline.from_single_file(file, config=tiny-pt)``'s and tiny-pt's with
both parts swapped and trailing spacing. Tolerance as for the folder pipeline: max 4/255, mean 0.5/255.
"""

import json

import jax
import numpy as np
import pytest

from sdxl_engine.checkpoint.loading import load_model
from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize
from sdxl_engine.program.schedulers import make_schedule
from sdxl_engine.program.sharding import make_mesh, replicated
from tests.helpers import FIXTURES, TINY_PT_MAX_STEPS

pytestmark = pytest.mark.engine

SINGLE = FIXTURES / "tiny-single"
REF = json.loads((SINGLE / "reference.json").read_text())
TINY_PT = FIXTURES / "tiny-pt"


@pytest.fixture(scope="module")
def arrays():
    with np.load(SINGLE / "arrays.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def models():
    """The single file (tiny-pt's configs), and tiny-pt with --unet, --vae and --timestep-spacing trailing."""
    common = dict(dtype="float32", platform="cpu", cache_dir="unused")
    single = load_model(str(SINGLE / "tiny-sdxl-sgm.fp16.safetensors"), model_config=str(TINY_PT), **common)
    swap = load_model(str(TINY_PT), unet=str(SINGLE / "unet-swap.bf16.safetensors"),
                      vae=str(SINGLE / "vae-ldm.safetensors"), timestep_spacing="trailing", **common)
    return {"single": single, "swap": swap}


@pytest.fixture(scope="module")
def program(models, tiny_pt_programs):
    """One compiled program (64x64, CFG, 2 given latents) for both, tiny-pt's of the session: the models have
    tiny-pt's configs (checked here), so only their parameters, which are the program's arguments, differ."""
    for name, component in tiny_pt_programs.model.components.items():
        assert [m.components[name].config for m in models.values()] == [component.config] * len(models), name
    mesh = tiny_pt_programs.mesh
    shape = ProgramShape(2, 64, 64, max_steps=TINY_PT_MAX_STEPS, cfg=True, given_latents=True)
    params = {name: jax.device_put(m.params, replicated(mesh)) for name, m in models.items()}
    return tiny_pt_programs[shape], params, shape


@pytest.mark.parametrize("case", ["single", "swap"])
def test_images_match_diffusers(models, program, arrays, case):
    """The engine's program on diffusers' latents: a single file as from_single_file loads it; a UNet swap
    (diffusers layout) with an LDM VAE and trailing spacing as diffusers runs them."""
    compiled, params, shape = program
    model, meta = models[case], REF["cases"][case]
    assert model.scheduler_config["timestep_spacing"] == meta["scheduler_config"]["timestep_spacing"]
    steps = meta["num_inference_steps"]
    schedule = make_schedule("Euler", model.scheduler_config, steps)
    np.testing.assert_allclose(schedule.timesteps[:steps], arrays[f"{case}_timesteps"], rtol=1e-6)
    ids, _ = tokenize(model, meta["prompt"])
    negative, _ = tokenize(model, meta["negative_prompt"])
    inputs = ProgramInputs.build(ids, negative, not meta["negative_prompt"], np.zeros(2, np.uint32),
                                 meta["guidance_scale"], schedule, steps, shape.max_steps,
                                 latents=arrays[f"{case}_latents"])
    images, finite = compiled.executable(params[case], inputs)
    assert np.asarray(finite).all()
    diff = np.abs(np.asarray(images).astype(np.float64) - arrays[f"{case}_images"] * 255)
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())


def test_loras_on_the_single_file_match_diffusers(models, program):
    """Both tiny-pt-lora LoRAs (kohya 0.8, PEFT 0.5) merged into the single file's params, against diffusers'
    from_single_file + load_lora_weights + set_adapters on the same latents (``make_fixtures single-lora``);
    and the LoRAs move the images well past the tolerance, so a layer mapped wrong would show."""
    from sdxl_engine.checkpoint import lora

    compiled, params, shape = program
    model, meta = models["single"], json.loads((SINGLE / "lora-reference.json").read_text())
    with np.load(SINGLE / "lora-reference.npz") as data:
        latents, expected = data["latents"], data["images"] * 255
    mesh = make_mesh(jax.devices()[:2])
    loras = {name: lora.read_lora(name, FIXTURES / "tiny-pt-lora" / f"{name}.safetensors", model.components)
             for name in ("kohya", "peft")}
    merger = lora.LoraMerger(params["single"], loras, replicated(mesh))
    schedule = make_schedule("Euler", model.scheduler_config, meta["steps"])
    ids, _ = tokenize(model, meta["prompt"])
    negative, _ = tokenize(model, "")

    def run(weights):
        inputs = ProgramInputs.build(ids, negative, True, np.zeros(2, np.uint32), meta["guidance_scale"], schedule,
                                     meta["steps"], shape.max_steps, latents=latents)
        images, finite = compiled.executable(merger.params(weights), inputs)
        assert np.asarray(finite).all()
        return np.asarray(images).astype(np.float64)

    weights = [(key.split("/")[1].removesuffix(".safetensors"), w) for key, w in meta["loras"].items()]
    diff = np.abs(run(weights) - expected)
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    assert np.abs(run([]) - expected).mean() > 5  # without the LoRAs: far off
