"""The program's inputs are declared once per field: specs, abstract inputs and built inputs agree (no compile)."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sdxl_engine.checkpoint.builtin import SDXL_SCHEDULER
from sdxl_engine.program import sharding
from sdxl_engine.program.generate import PER_IMAGE, REPLICATED, TOKENS, ProgramInputs, ProgramShape
from sdxl_engine.program.schedulers import make_schedule

LATENT = (4, 8, 6)  # (C, h, w)


@pytest.mark.parametrize("given_latents, init_image", [(False, False), (True, False), (False, True)])
def test_specs_abstract_and_built_inputs_have_one_structure(given_latents, init_image):
    """What jit's shardings, the lowering and a request's call each take is derived from the same
    declarations: one tree structure, and every built array has its declared shape and dtype."""
    mesh = sharding.make_mesh()
    n = mesh.devices.size
    shape = ProgramShape(n, 64, 48, max_steps=7, given_latents=given_latents, init_image=init_image)
    specs, abstract = ProgramInputs.specs(shape), ProgramInputs.abstract(shape, LATENT, mesh)
    latents = np.zeros((n, *LATENT), np.float32) if given_latents else None
    image = np.zeros((n, 64, 48, 3), np.uint8) if init_image else None
    built = ProgramInputs.build(np.zeros((2, TOKENS), np.int32), np.zeros((2, TOKENS), np.int32), True, range(n), 5.0,
                                make_schedule("Euler", SDXL_SCHEDULER, 5), 5, shape.max_steps, latents=latents,
                                image=image, start_step=2 if init_image else None)
    structure = jax.tree.structure(built)
    assert jax.tree.structure(abstract) == structure
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == structure
    for field in dataclasses.fields(ProgramInputs):
        value, struct, spec = (getattr(t, field.name) for t in (built, abstract, specs))
        if value is None:
            assert struct is None and spec is None, field.name
            continue
        assert (np.shape(value), np.asarray(value).dtype) == (struct.shape, struct.dtype), field.name
        assert spec == (P(sharding.DATA_AXIS) if field.metadata["partition"] == PER_IMAGE else P()), field.name
        assert struct.sharding.spec == spec, field.name


def test_an_optional_input_exists_only_with_its_flag():
    mesh = sharding.make_mesh()
    off = ProgramShape(mesh.devices.size, 64, 64, 4)
    on = dataclasses.replace(off, given_latents=True)
    assert ProgramInputs.specs(off).latents is None and ProgramInputs.abstract(off, LATENT, mesh).latents is None
    assert ProgramInputs.specs(on).latents == P(sharding.DATA_AXIS)
    assert ProgramInputs.abstract(on, LATENT, mesh).latents.shape == (mesh.devices.size, *LATENT)
    assert ProgramInputs.specs(off).image is None and ProgramInputs.specs(off).start_step is None
    img2img = ProgramInputs.abstract(dataclasses.replace(off, init_image=True), LATENT, mesh)
    assert (img2img.image.shape, img2img.image.dtype) == ((mesh.devices.size, 64, 64, 3), np.uint8)
    assert (img2img.start_step.shape, img2img.start_step.dtype) == ((), np.int32)


def test_every_input_declares_partition_dims_and_dtype():
    for field in dataclasses.fields(ProgramInputs):
        meta = field.metadata
        assert meta["partition"] in (PER_IMAGE, REPLICATED), field.name
        assert callable(meta["dims"]) or isinstance(meta["dims"], tuple), field.name
        assert meta["when"] is None or isinstance(getattr(ProgramShape(4, 64, 64, 4), meta["when"]), bool), field.name
