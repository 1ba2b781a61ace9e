"""Every normalisation layer's epsilon (and group count) is the one diffusers/transformers give it for the config.

A changed epsilon moves the tiny models' outputs by less than the image tolerances, so it is checked
here layer by layer, on the modules built from a config (no weights). The rules, from the PyTorch
sources the modules follow:

* UNet2DConditionModel (diffusers unets/unet_2d_condition.py, unet_2d_blocks.py, resnet.py): every
  ResnetBlock2D's ``norm1``/``norm2`` and ``conv_norm_out`` use ``norm_eps`` (passed as ``resnet_eps``)
  with ``norm_num_groups`` groups; a Transformer2DModel's ``norm`` is GroupNorm with eps 1e-6 fixed
  (transformers/transformer_2d.py); its BasicTransformerBlocks' ``norm1``-``norm3`` LayerNorms use the
  Transformer2DModel's ``norm_eps``, which the UNet's blocks never pass: its default, 1e-5
  (attention.py).
* AutoencoderKL (diffusers autoencoders/vae.py): every GroupNorm (resnets, the mid-block attention's
  ``group_norm``, ``conv_norm_out``) has eps 1e-6 fixed (``resnet_eps=1e-6``) and ``norm_num_groups``
  groups; its config has no epsilon field.
* CLIPTextModel / WithProjection (transformers models/clip/modeling_clip.py): ``layer_norm1``,
  ``layer_norm2`` and ``final_layer_norm`` use ``layer_norm_eps``.
"""

import json
from pathlib import Path

import pytest
from flax import nnx

from sdxl_engine.models import COMPONENTS
from sdxl_engine.models.layers import GroupNorm, LayerNorm
from tests.helpers import FIXTURES, ROOT

CONFIGS = ROOT / "sdxl_engine" / "checkpoint" / "configs" / "sdxl-base-1.0"


def norms(name: str, config: dict) -> dict[str, tuple[str, float, int | None]]:
    """{module path: (kind, eps, groups)} of every GroupNorm and LayerNorm of component ``name``
    built from ``config`` (abstractly: no parameter memory)."""
    config_cls, module_cls, _ = COMPONENTS[name]
    module = nnx.eval_shape(lambda: module_cls(config_cls.from_dict(config), rngs=nnx.Rngs(0)))
    out = {}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, (GroupNorm, LayerNorm)):
            kind = type(node).__name__
            out[".".join(map(str, path))] = (kind, node.eps, node.num_groups if kind == "GroupNorm" else None)
    return out


def expected(name: str, path: str, config: dict) -> tuple[str, float, int | None]:
    """(kind, eps, groups) that diffusers/transformers give the layer at ``path`` (the module docstring's
    rules); AssertionError for a norm layer the rules do not know."""
    leaf = path.rsplit(".", 1)[-1]
    if name in ("text_encoder", "text_encoder_2"):
        assert leaf in ("layer_norm1", "layer_norm2", "final_layer_norm"), path
        return "LayerNorm", config.get("layer_norm_eps", 1e-5), None
    groups = config.get("norm_num_groups", 32)
    if name == "vae":
        assert leaf in ("norm1", "norm2", "group_norm", "conv_norm_out"), path
        return "GroupNorm", 1e-6, groups
    eps = config.get("norm_eps", 1e-5)
    if ".transformer_blocks." in path:
        assert leaf in ("norm1", "norm2", "norm3"), path
        return "LayerNorm", 1e-5, None
    if ".attentions." in path:
        assert leaf == "norm", path
        return "GroupNorm", 1e-6, groups
    assert ".resnets." in path and leaf in ("norm1", "norm2") or path == "conv_norm_out", path
    return "GroupNorm", eps, groups


def config_of(folder: Path, name: str, **overrides) -> dict:
    return {**json.loads((folder / name / "config.json").read_text()), **overrides}


def check(name: str, config: dict) -> dict[str, tuple]:
    found = norms(name, config)
    assert found, name
    wrong = {p: (got, expected(name, p, config)) for p, got in found.items() if got != expected(name, p, config)}
    assert wrong == {}, f"{name}: {len(wrong)} of {len(found)} norm layers differ (got, expected): {wrong}"
    return found


@pytest.mark.parametrize("folder, name", [
    pytest.param(folder, name, id=f"{folder.name}-{name}")
    for folder in (FIXTURES / "tiny-pt", FIXTURES / "tiny-pt-conv", CONFIGS)
    for name in COMPONENTS if (folder / name / "config.json").is_file()])
def test_every_norm_layer_has_the_configs_epsilon(folder, name):
    found = check(name, config_of(folder, name))
    if name == "unet":  # each of the UNet's rules applies somewhere (none is vacuous)
        assert {"resnets", "attentions", "transformer_blocks", "conv_norm_out"} <= {
            part for p in found for part in p.split(".")}


@pytest.mark.parametrize("name, overrides", [
    ("unet", {"norm_eps": 1e-3, "norm_num_groups": 4}),
    ("vae", {"norm_eps": 1e-3}),  # not an AutoencoderKL field: diffusers ignores it, so must the VAE
    ("text_encoder", {"layer_norm_eps": 1e-3}),
    ("text_encoder_2", {"layer_norm_eps": 3e-4}),
])
def test_a_non_default_epsilon_reaches_the_layers_it_rules(name, overrides):
    """A config epsilon other than the usual 1e-5 (so a value hard-coded in a module fails) reaches exactly
    the layers that read it; the fixed ones keep theirs."""
    found = check(name, config_of(FIXTURES / "tiny-pt", name, **overrides))
    eps = {e for _, e, _ in found.values()}
    if name == "unet":
        assert eps == {1e-3, 1e-6, 1e-5}
    elif name == "vae":
        assert eps == {1e-6}
    else:
        assert eps == {overrides["layer_norm_eps"]}
