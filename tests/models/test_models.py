"""The own Flax modules against the references: diffusers' PyTorch outputs, the deleted Flax
classes' outputs, and the images the previous engine made with tiny-shapes.

Fixtures (tests/fixtures/README.md says how each was made): ``tiny-pt`` and ``tiny-pt-conv``
are random SDXLs saved by diffusers/transformers' PyTorch classes with their outputs in
``tiny-pt-reference``; ``legacy-flax`` is a micro SDXL saved by the deleted Flax classes
(msgpack); ``tiny-shapes-reference`` holds the images main's engine made before the switch.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdxl_engine.checkpoint import weights
from sdxl_engine.checkpoint.loading import load_folder, read_model_folder
from sdxl_engine.models import build_component
from sdxl_engine.program.generate import ProgramInputs, ProgramShape, latent_shape, tokenize
from sdxl_engine.program.schedulers import make_schedule
from tests.helpers import FIXTURES, ROOT, TINY_PT_MAX_STEPS, Programs

pytestmark = pytest.mark.engine

REF_DIR = FIXTURES / "tiny-pt-reference"
REF = json.loads((REF_DIR / "reference.json").read_text())


def first_shape_only(cases: list[dict]) -> list:
    """The indices of ``cases`` for parametrize: those of another program shape than 64x64 with guidance
    are marked slow (each compiles one more program)."""
    return [k if (case["width"], case["height"], case["guidance_scale"] > 1) == (64, 64, True)
            else pytest.param(k, marks=pytest.mark.slow) for k, case in enumerate(cases)]


@pytest.fixture(scope="module")
def arrays():
    with np.load(REF_DIR / "arrays.npz") as data:  # no pickles: allow_pickle stays False
        return dict(data)


def jitted(component, params, method: str = "__call__"):
    """``component``'s module ``method`` on ``params`` as one jitted function of its inputs: one compile in
    place of eager op-by-op dispatch (the same maths, as the engine's program runs it)."""
    return functools.partial(jax.jit(lambda p, *args: getattr(component.bind(p), method)(*args)), params)


def close(actual, name, arrays, prefix=""):
    tol = REF["arrays"][prefix + name]["tolerance"]
    np.testing.assert_allclose(np.asarray(actual, np.float32), arrays[prefix + name], rtol=tol["rtol"],
                               atol=tol["atol"], err_msg=prefix + name)


def test_full_size_sdxl_base_keys_map_one_to_one():
    """Every parameter of SDXL 1.0 base (diffusers/transformers' save_pretrained keys, from the real
    configs) is one parameter of the own modules, same name and (layout-ruled) shape, none left over."""
    expected = json.loads((FIXTURES / "sdxl-base-keys.json").read_text())
    components = read_model_folder(ROOT / "sdxl_engine" / "checkpoint" / "configs" / "sdxl-base-1.0")
    for name, component in components.items():
        ours = {k: weights.module_shape(tuple(s)) for k, s in expected[name].items()}
        mapping, unexpected = weights._map_keys(component, list(expected[name]))
        assert unexpected == [] and sorted(mapping.values()) == sorted(component.shapes), name
        assert {mapping[k]: v for k, v in ours.items()} == dict(component.shapes), name
    assert sum(int(np.prod(s)) for s in components["unet"].shapes.values()) == 2_567_463_684


def test_tokenizers_match_transformers(tiny_pt, arrays):
    for i, prompt in enumerate(REF["prompts"]):
        ids, truncated = tokenize(tiny_pt, prompt)
        assert not truncated
        np.testing.assert_array_equal(ids[0], arrays["ids_1"][i])
        np.testing.assert_array_equal(ids[1], arrays["ids_2"][i])  # tokenizer_2 pads with "!"


def test_text_encoders_match_pytorch(tiny_pt, arrays):
    te1 = jitted(tiny_pt.components["text_encoder"], tiny_pt.params["text_encoder"])
    te2 = jitted(tiny_pt.components["text_encoder_2"], tiny_pt.params["text_encoder_2"])
    out1, out2 = te1(jnp.asarray(arrays["ids_1"])), te2(jnp.asarray(arrays["ids_2"]))
    close(out1.penultimate, "te1_hidden", arrays)
    close(out1.last_hidden_state, "te1_last", arrays)
    close(out1.pooled, "te1_pooled", arrays)
    close(out2.penultimate, "te2_hidden", arrays)
    close(out2.text_embeds, "te2_text_embeds", arrays)


# conv_: the same check on the fixture whose UNet has conv shortcuts; slow (a second UNet and VAE compile)
@pytest.mark.parametrize("prefix", ["", pytest.param("conv_", marks=pytest.mark.slow)])
def test_unet_and_vae_match_pytorch(prefix, arrays):
    folder = FIXTURES / ("tiny-pt-conv" if prefix else "tiny-pt")
    for name in ("unet", "vae"):
        component = build_component(name, json.loads((folder / name / "config.json").read_text()))
        params = weights.load_params(component, weights.find_weight_files(folder / name), np.float32)
        if name == "unet":
            a = {k: arrays[prefix + "unet_" + k] for k in ("sample", "timesteps", "encoder_hidden_states",
                                                          "text_embeds", "time_ids")}
            close(jitted(component, params)(a["sample"], a["timesteps"], a["encoder_hidden_states"], a["text_embeds"],
                                            a["time_ids"]), "unet_out", arrays, prefix)
        else:
            close(jitted(component, params, "decode")(arrays[prefix + "vae_decode_in"]), "vae_decode_out", arrays,
                  prefix)
            mean, logvar = jitted(component, params, "encode")(arrays[prefix + "vae_encode_in"])
            close(mean, "vae_encode_mean", arrays, prefix)
            close(logvar, "vae_encode_logvar", arrays, prefix)


@pytest.mark.slow  # compiles the UNet and the VAE a second time, in strips
def test_the_unet_and_vae_in_strips_match_pytorch(arrays, monkeypatch):
    """layers.CONV_MODE "strips" (on a TPU, "auto" takes it for one image's wide convolutions): every 3x3 convolution
    of the UNet (16² and 8² latents) and the VAE cut into 4 strips with their neighbouring rows, and the outputs are
    still diffusers' to test_unet_and_vae_match_pytorch's tolerances."""
    from sdxl_engine.models import layers

    ran = []
    monkeypatch.setattr(layers, "CONV_MODE", "strips")
    monkeypatch.setattr(layers, "conv_strips", lambda x, w, n, run=layers.conv_strips: ran.append(x.shape) or
                        run(x, w, n))
    folder = FIXTURES / "tiny-pt"
    unet = build_component("unet", json.loads((folder / "unet" / "config.json").read_text()))
    params = weights.load_params(unet, weights.find_weight_files(folder / "unet"), np.float32)
    a = [arrays["unet_" + k] for k in ("sample", "timesteps", "encoder_hidden_states", "text_embeds", "time_ids")]
    close(jitted(unet, params)(*a), "unet_out", arrays)
    assert {s[1] for s in ran} == {16, 8}, ran  # both latent levels that 4 strips divide took them
    vae = build_component("vae", json.loads((folder / "vae" / "config.json").read_text()))
    params = weights.load_params(vae, weights.find_weight_files(folder / "vae"), np.float32)
    close(jitted(vae, params, "decode")(arrays["vae_decode_in"]), "vae_decode_out", arrays)


def test_the_unet_takes_its_text_keys_and_values_computed_once(arrays):
    """``text_kv`` (each cross-attention's keys and values of the text, projected once per request instead of at
    every step) given to the call makes the call's own output, so diffusers' too; its entries are the
    cross-attentions in the order the call runs them, a wrong one changes the output, one too many is refused."""
    from sdxl_engine.models.ip_adapter import cross_attention_layers, forward_order

    folder = FIXTURES / "tiny-pt"
    component = build_component("unet", json.loads((folder / "unet" / "config.json").read_text()))
    params = weights.load_params(component, weights.find_weight_files(folder / "unet"), np.float32)
    args = [arrays["unet_" + k] for k in ("sample", "timesteps", "encoder_hidden_states", "text_embeds", "time_ids")]

    text_kv = jax.jit(lambda p, hidden: component.bind(p).text_kv(hidden))
    with_kv = jax.jit(lambda p, args, kv: component.bind(p)(*args, text_kv=kv))  # one compile for both kv below
    kv = text_kv(params, args[2])
    once, every_step = with_kv(params, args, kv), jitted(component, params)(*args)
    np.testing.assert_allclose(np.asarray(once), np.asarray(every_step), rtol=0, atol=1e-6)
    close(once, "unet_out", arrays)
    swapped = with_kv(params, args, (kv[1], kv[0], *kv[2:]))  # the first two cross-attentions' entries exchanged
    assert np.abs(np.asarray(swapped) - np.asarray(every_step)).max() > 1e-3

    unet = component.bind(params)
    names = [cross_attention_layers(component.config)[j][0] for j in forward_order(component.config)]
    modules = [functools.reduce(lambda m, part: m[int(part)] if part.isdigit() else getattr(m, part),
                                name.split("."), unet) for name in names]
    assert len(unet.cross_attentions()) == len(names) > 2
    assert all(a is b for a, b in zip(unet.cross_attentions(), modules, strict=True))
    with pytest.raises(ValueError, match="text_kv has more entries than the UNet has cross-attention layers"):
        jax.eval_shape(lambda: unet(*args, text_kv=(*kv, kv[0])))  # traced, not run


SAMPLER_OF = {"euler-leading": "Euler", "euler-trailing": "Euler", "euler-linspace": "Euler", "dpm++2m": "DPM++ 2M",
              "dpm++2m-karras": "DPM++ 2M Karras", "ddim": "DDIM"}


def run_case(programs: Programs, case: dict, latents: np.ndarray) -> np.ndarray:
    """The engine's compiled program on diffusers' initial latents: (n, H, W, 3) uint8."""
    model = programs.model
    n, steps = latents.shape[0], case["num_inference_steps"]
    shape = ProgramShape(n, case["height"], case["width"], max_steps=TINY_PT_MAX_STEPS,
                         cfg=case["guidance_scale"] > 1, given_latents=True)
    assert latent_shape(model, shape.height, shape.width) == latents.shape[1:]
    config = {**model.scheduler_config, **{k: v for k, v in case["from_config_overrides"].items()
                                          if k == "timestep_spacing"}}
    schedule = make_schedule(SAMPLER_OF[case["scheduler_variant"]], config, steps)
    ids, _ = tokenize(model, case["prompt"])
    negative, _ = tokenize(model, case["negative_prompt"])
    inputs = ProgramInputs.build(ids, negative, not case["negative_prompt"], np.zeros(n, np.uint32),
                                 case["guidance_scale"], schedule, steps, shape.max_steps, latents=latents)
    images, finite = programs[shape].executable(programs.params, inputs)
    assert np.asarray(finite).all()
    return np.asarray(images)


@pytest.mark.slow  # compiles tiny-pt's programs (the component comparisons above stay quick)
@pytest.mark.parametrize("k", range(len(REF["cases"])))
def test_images_match_diffusers_pipeline(tiny_pt_programs, arrays, k):
    """diffusers' StableDiffusionXLPipeline and the engine's program, same latents: max 4/255, mean 0.5/255.

    Cases: Euler with CFG (leading spacing, a negative prompt, 80x48, linspace), guidance 1 and 0
    (no CFG, as diffusers decides; the second with trailing spacing), DPM++ 2M, DPM++ 2M Karras, DDIM.
    """
    case = REF["cases"][k]
    assert case["cfg_applied"] == (case["guidance_scale"] > 1)
    images = run_case(tiny_pt_programs, case, arrays[f"case{k}_latents"])
    diff = np.abs(images.astype(np.float64) - arrays[f"case{k}_images"] * 255)
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())


@pytest.mark.slow  # compiles tiny-pt's text-to-image program a second time, with the TPU's GELU
def test_the_tpus_tanh_gelu_keeps_the_images_within_the_diffusers_tolerance(tiny_pt, tiny_pt_programs, arrays,
                                                                            monkeypatch):
    """models/unet's "auto" GEGLU_MODE is "split-tanh" on a TPU (the GELU of the blog's pipeline, flax's nn.gelu):
    traced with it, case 0's program (Euler, CFG, 80x48) still makes diffusers' images (exact GELU) within
    test_images_match_diffusers_pipeline's tolerance, and not the exact program's images (the mode took effect)."""
    from sdxl_engine.models import unet
    from sdxl_engine.program.sharding import make_mesh

    exact = run_case(tiny_pt_programs, REF["cases"][0], arrays["case0_latents"])
    monkeypatch.setattr(unet, "GEGLU_MODE", "split-tanh")
    images = run_case(Programs(tiny_pt, make_mesh(jax.devices()[:2])), REF["cases"][0], arrays["case0_latents"])
    diff = np.abs(images.astype(np.float64) - arrays["case0_images"] * 255)
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    assert np.abs(images.astype(np.int16) - exact.astype(np.int16)).max() >= 1


def test_geglu_auto_is_the_tanh_gelu_on_a_tpu_and_the_exact_one_elsewhere(monkeypatch):
    from sdxl_engine.models import unet

    assert unet.GEGLU_MODE == "auto"
    for backend, mode in (("tpu", "split-tanh"), ("cpu", "split"), ("gpu", "split")):
        monkeypatch.setattr(unet.jax, "default_backend", lambda backend=backend: backend)
        assert unet.geglu_mode() == mode
    monkeypatch.setattr(unet, "GEGLU_MODE", "split-erf")
    assert unet.geglu_mode() == "split-erf"  # a mode set by hand stays


@pytest.mark.slow  # jits a second model's text encoders and UNet
def test_legacy_flax_msgpack_matches_the_deleted_flax_classes():
    """A folder saved by diffusers'/transformers' Flax classes loads by rule and computes what they computed."""
    folder = FIXTURES / "legacy-flax"
    model = load_folder(folder, "legacy", "float32")
    with np.load(folder / "reference.npz") as data:
        ref = dict(data)
    te1, te2, unet = (jitted(model.components[n], model.params[n]) for n in ("text_encoder", "text_encoder_2", "unet"))
    np.testing.assert_allclose(te1(ref["ids"]).penultimate, ref["te1_hidden"], rtol=1e-4, atol=1e-5)
    out2 = te2(ref["ids"])
    np.testing.assert_allclose(out2.penultimate, ref["te2_hidden"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out2.text_embeds, ref["te2_text_embeds"], rtol=1e-4, atol=1e-5)
    out = unet(ref["unet_sample"], ref["unet_timesteps"], ref["unet_encoder_hidden_states"], ref["unet_text_embeds"],
               ref["unet_time_ids"])
    # diffusers' Flax UNet used GroupNorm epsilon 1e-5 inside its transformers where PyTorch (and the own
    # modules) use 1e-6: a few 1e-4 of difference; a key mapped wrong would differ by order 1.
    np.testing.assert_allclose(out, ref["unet_out"], rtol=1e-4, atol=2e-3)
    decode = jitted(model.components["vae"], model.params["vae"], "decode")
    np.testing.assert_allclose(decode(ref["vae_decode_in"]), ref["vae_decode_out"], rtol=1e-4, atol=5e-5)


def test_saved_safetensors_load_in_pytorch_layout_and_round_trip(tmp_path, tiny_pt):
    """weights.save_params writes PyTorch layout (conv kernels (out, in, kh, kw)); loading it back is exact."""
    from safetensors.numpy import load_file

    unet = tiny_pt.components["unet"]
    params = {k: np.asarray(v) for k, v in tiny_pt.params["unet"].items()}
    path = weights.save_params(params, tmp_path / "unet" / "diffusion_pytorch_model.safetensors")
    original = load_file(str(FIXTURES / "tiny-pt" / "unet" / "diffusion_pytorch_model.safetensors"))
    saved = load_file(str(path))
    assert saved.keys() == original.keys() and all(np.array_equal(saved[k], original[k]) for k in saved)
    again = weights.load_params(unet, [path], np.float32)
    assert all(np.array_equal(np.asarray(again[k]), params[k]) for k in params)


TINY_SHAPES = json.loads((FIXTURES / "tiny-shapes-reference.json").read_text())


@pytest.mark.parametrize("k", first_shape_only(TINY_SHAPES["cases"]))
def test_tiny_shapes_images_unchanged(tiny_shapes_engine, k, monkeypatch):
    """The previous engine (diffusers' Flax classes) made these images. With its integer timesteps the
    own modules give the same pixels (max 2/255); the engine now passes the scheduler's float
    timesteps to the UNet as diffusers' PyTorch pipeline does, which moves them by mean <= 0.5/255."""
    from sdxl_engine.engine import plan as engine_module  # where the schedules are made
    from sdxl_engine.engine.validation import GenerateRequest

    case = TINY_SHAPES["cases"][k]
    request = GenerateRequest(case["prompt"], case["negative_prompt"], case["seed"], case["guidance_scale"],
                              case["num_inference_steps"], case["width"], case["height"])
    with np.load(FIXTURES / "tiny-shapes-reference.npz") as data:
        expected = data[f"case{k}_images"].astype(np.int32)
    now = tiny_shapes_engine.generate(request)
    assert now.seeds == case["seeds"]
    assert np.abs(now.images.astype(np.int32) - expected).mean() <= 0.5

    def integer_timesteps(sampler, config, steps, schedule_type=None, eta=None):
        schedule = make_schedule(sampler, config, steps, schedule_type, eta)
        return dataclasses.replace(schedule, timesteps=np.floor(schedule.timesteps))

    monkeypatch.setattr(engine_module, "make_schedule", integer_timesteps)
    monkeypatch.setattr(tiny_shapes_engine.planner, "_schedules", {})
    before = tiny_shapes_engine.generate(request)
    assert np.abs(before.images.astype(np.int32) - expected).max() <= 2


@pytest.mark.parametrize("mode", ["split", "fused", "split-erf", "split-tanh", "split-sigmoid"])
def test_geglu_is_diffusers_value_times_gelu_of_the_gate_in_each_mode(mode, monkeypatch):
    """models/unet.GEGLU in each of its GEGLU_MODEs against diffusers' GEGLU written out in float64 on fixed
    non-square inputs: proj's rows are value's then gate's, out = value · 0.5·gate·(1 + erf(gate/√2)) (PyTorch's
    exact GELU), or, in the tanh modes, value · 0.5·gate·(1 + tanh(√(2/π)·(gate + 0.044715·gate³))) (diffusers'
    FlaxGEGLU, flax's nn.gelu), which is within 4.8e-4 of the exact one."""
    import math

    from flax import nnx

    from sdxl_engine.models import unet

    assert set(unet.GEGLU_MODES) == {"split", "fused", "split-erf", "split-tanh", "split-sigmoid"}
    monkeypatch.setattr(unet, "GEGLU_MODE", mode)
    geglu = unet.GEGLU(6, 10, rngs=nnx.Rngs(3))
    x = np.random.default_rng(4).standard_normal((2, 5, 6)).astype(np.float32) * 2
    w, b = np.asarray(geglu.proj.weight[...], np.float64), np.asarray(geglu.proj.bias[...], np.float64)
    h = x.astype(np.float64) @ w.T + b
    value, gate = h[..., :10], h[..., 10:]
    exact = 0.5 * gate * (1 + np.vectorize(math.erf)(gate / math.sqrt(2)))
    tanh_form = 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
    assert 1e-5 < np.abs(tanh_form - exact).max() < 4.8e-4  # the two formulas, as far apart as they are
    expected = value * (tanh_form if mode in ("split-tanh", "split-sigmoid") else exact)
    out = np.asarray(geglu(jnp.asarray(x)))
    assert out.shape == (2, 5, 10) and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)
