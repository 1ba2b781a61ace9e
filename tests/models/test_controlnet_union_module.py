"""models/controlnet_union.py against diffusers' ControlNetUnionModel, and its loading by class.

Reference: tests/fixtures/tiny-pt-controlnet-union/ (``python -m tools.make_fixtures controlnet-union``, the torch
venv): ``union``, a ControlNet-Union made from tiny-pt's UNet (8 control types, its zero-initialised parts random,
saved in float16), and two calls of it in float32 on fixed 4-row inputs (``module_*``): one image of type 3 at
scale 0.7, two images of types 1 and 3 at 0.7 and 0.5.
"""

import json

import numpy as np
import pytest

from tests.helpers import FIXTURES

FOLDER = FIXTURES / "tiny-pt-controlnet-union"


@pytest.fixture(scope="module")
def reference():
    with np.load(FOLDER / "reference.npz") as data:
        return {k[len("module_"):]: v for k, v in data.items() if k.startswith("module_")}


@pytest.fixture(scope="module")
def union():
    from sdxl_engine.checkpoint.controlnet import load_controlnet

    return load_controlnet("union", FOLDER / "union", "float32", log=lambda line: None)


def test_a_union_folder_loads_as_a_union(union):
    """config.json's ControlNetUnionModel builds the union module: its config, 8 types, the union's keys by
    diffusers' names (``transformer_layes``, sic), and an architecture id of its own."""
    from sdxl_engine.checkpoint.controlnet import load_controlnet
    from sdxl_engine.models.controlnet_union import ControlNetUnionConfig

    config = union.component.config
    assert union.component.name == "controlnet_union" and isinstance(config, ControlNetUnionConfig)
    assert union.union == 8 and config.residuals == 10 and config.num_trans_channel == 16
    keys = union.component.shapes
    assert keys["task_embedding"] == (8, 16) and keys["transformer_layes.0.attn.in_proj_weight"] == (48, 16)
    assert {"spatial_ch_projs.weight", "control_add_embedding.linear_1.weight",
            "transformer_layes.0.mlp.c_fc.weight"} <= set(keys)
    plain = load_controlnet("cn-a", FIXTURES / "tiny-pt-controlnet" / "cn-a", "float32", log=lambda line: None)
    assert plain.union == 0 and plain.architecture != union.architecture


@pytest.mark.parametrize("case,types,scales", [("one", [3], [0.7]), ("two", [1, 3], [0.7, 0.5])])
def test_residuals_match_diffusers(union, reference, case, types, scales):
    """Each of the 10 residuals within 1e-4 (relative to its largest value) of diffusers' on 4 rows (the token
    attention runs over the rows: all four in one call, as diffusers')."""
    import jax
    import jax.numpy as jnp

    r = reference
    call = jax.jit(lambda params, *args: union.component.bind(params)(*args))  # one compile, not op-by-op dispatch
    down, mid = call(union.params, *(jnp.asarray(r[k]) for k in ("sample", "timestep", "hidden", "text_embeds",
                                                                  "time_ids")),
                     jnp.asarray(r["cond"][:len(types)]), jnp.asarray(scales), jnp.asarray(types))
    for k, got in enumerate([*down, mid]):
        want = r[f"{case}_down_{k}"] if k < 9 else r[f"{case}_mid"]
        err = np.abs(np.asarray(got) - want).max() / np.abs(want).max()
        assert err < 1e-4, (case, k, err)


def test_rows_split_over_devices_attend_over_every_row(union, reference):
    """Under shard_map with the rows over 2 devices (``rows_axis``), the residuals are the one-call residuals: the
    token attention gathers every device's rows."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from sdxl_engine.program.sharding import DATA_AXIS, make_mesh

    r = reference
    mesh = make_mesh(jax.devices()[:2])
    graph, params = union.component, union.params

    def call(sample, t, hidden, text, time_ids, cond):
        return graph.bind(params)(sample, t, hidden, text, time_ids, cond, jnp.asarray([0.7, 0.5]),
                                  jnp.asarray([1, 3]), rows_axis=DATA_AXIS)

    rows = P(DATA_AXIS)
    split = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=(rows, rows, rows, rows, rows, P(None, DATA_AXIS)),
                                  out_specs=rows))
    args = [jnp.asarray(r[k]) for k in ("sample", "timestep", "hidden", "text_embeds", "time_ids")]
    down, mid = split(*args, jnp.asarray(r["cond"]))
    err = np.abs(np.asarray(mid) - r["two_mid"]).max() / np.abs(r["two_mid"]).max()
    assert err < 1e-4, err


def test_a_single_union_file_loads_with_its_config_beside_it(tmp_path):
    """The union's weights file alone needs its config (the head count is in no tensor): refused naming what to do;
    with config.json beside it, it loads as the folder does."""
    import shutil

    from sdxl_engine.checkpoint.controlnet import load_controlnet
    from sdxl_engine.checkpoint.weights import ModelLoadError

    single = tmp_path / "union-promax.safetensors"
    shutil.copy(FOLDER / "union" / "diffusion_pytorch_model.safetensors", single)
    unet = json.loads((FIXTURES / "tiny-pt" / "unet" / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="ControlNet-Union file; put its config.json"):
        load_controlnet("u", single, "float32", unet, log=lambda line: None)
    shutil.copy(FOLDER / "union" / "config.json", tmp_path / "union-promax.json")
    assert load_controlnet("u", single, "float32", unet, log=lambda line: None).union == 8


def test_union_configs_are_refused_by_field():
    from sdxl_engine.models import build_component

    config = json.loads((FOLDER / "union" / "config.json").read_text())
    for field, value in (("num_trans_channel", 32), ("num_trans_head", 3),
                         ("controlnet_conditioning_channel_order", "bgr")):
        with pytest.raises(ValueError, match=field):
            build_component("controlnet_union", {**config, field: value})
