"""Few-step models' recipes (checkpoint/recipes.py): found by their files' names, applied when such a UNet, model or
LoRA is loaded, and yielding to an explicit setting, a model's own engine_defaults.json and a request's values."""

import json
import os

import numpy as np
import pytest

from sdxl_engine.checkpoint import recipes
from sdxl_engine.checkpoint.loading import ENGINE_DEFAULTS_FILE, engine_defaults, load_model
from sdxl_engine.config import EngineConfig, resolve_defaults
from tests.helpers import FIXTURES

TINY_PT = FIXTURES / "tiny-pt"
LOAD = dict(dtype="float32", platform="cpu", cache_dir="unused")
CACHES = {k: v for k, v in os.environ.items() if k in ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")}


@pytest.mark.parametrize("spec, name, sampler, steps, guidance, scheduler", [
    ("ByteDance/SDXL-Lightning/sdxl_lightning_4step_unet.safetensors", "SDXL-Lightning 4-step", "Euler", 4, 0.0,
     {"timestep_spacing": "trailing"}),
    ("/m/sdxl_lightning_8step.safetensors", "SDXL-Lightning 8-step", "Euler", 8, 0.0, {"timestep_spacing": "trailing"}),
    ("sdxl_lightning_1step_unet_x0.safetensors", "SDXL-Lightning 1-step (x0)", "Euler", 1, 0.0,
     {"timestep_spacing": "trailing", "prediction_type": "sample"}),
    ("dmd2_sdxl_4step_unet_fp16.safetensors", "DMD2 4-step", "LCM", 4, 0.0, {"original_inference_steps": 4}),
    ("Hyper-SDXL-1step-Unet-Comfyui.fp16.safetensors", "Hyper-SDXL 1-step UNet", "LCM", 1, 0.0,
     {"custom_timesteps": [800]}),
    ("dmd2_sdxl_1step_unet_fp16.safetensors", "DMD2 1-step", "LCM", 1, 0.0, {"custom_timesteps": [399]}),
    ("stabilityai/sdxl-turbo", "SDXL-Turbo", "Euler a", 1, 0.0, {"timestep_spacing": "trailing"}),
    ("sd_xl_turbo_1.0_fp16.safetensors", "SDXL-Turbo", "Euler a", 1, 0.0, {"timestep_spacing": "trailing"}),
])
def test_a_models_recipe_is_found_by_its_published_name(spec, name, sampler, steps, guidance, scheduler):
    recipe = recipes.find(spec)
    assert (recipe.name, recipe.scheduler) == (name, scheduler) and not recipe.lora
    assert (recipe.defaults["sampler"], recipe.defaults["num_inference_steps"], recipe.defaults["guidance_scale"]) == (
        sampler, steps, guidance)
    assert recipe.source.startswith("https://huggingface.co/")
    EngineConfig.load(environ={}).with_model_defaults(recipe.engine_defaults())  # engine_defaults.json's form


@pytest.mark.parametrize("spec, name, sampler, steps, guidance, schedule_type", [
    ("sdxl_lightning_2step_lora.safetensors", "SDXL-Lightning 2-step LoRA", "Euler", 2, 0.0, "trailing"),
    ("Hyper-SDXL-8steps-lora.safetensors", "Hyper-SDXL 8-step LoRA", "DDIM", 8, 0.0, "trailing"),
    ("Hyper-SDXL-12steps-CFG-lora.safetensors", "Hyper-SDXL 12-step CFG LoRA", "DDIM", 12, 5.0, "trailing"),
    ("Hyper-SDXL-1step-lora.safetensors", "Hyper-SDXL 1-step LoRA", "TCD", 1, 0.0, "automatic"),
    ("dmd2_sdxl_4step_lora_fp16.safetensors", "DMD2 4-step LoRA", "LCM", 4, 0.0, "trailing"),
])
def test_a_loras_recipe_is_found_by_its_file_name_and_only_as_a_lora(spec, name, sampler, steps, guidance,
                                                                     schedule_type):
    recipe = recipes.find(spec, lora=True)
    assert (recipe.name, recipe.defaults["sampler"], recipe.defaults["num_inference_steps"],
            recipe.defaults["guidance_scale"], recipe.defaults["schedule_type"]) == (
        name, sampler, steps, guidance, schedule_type)
    assert recipes.find(spec) is None and not recipe.scheduler


def test_other_names_have_no_recipe():
    for spec in ("stabilityai/stable-diffusion-xl-base-1.0", "juggernautXL_v9.safetensors", "tiny-shapes",
                 "sdxl_lightning_3step_unet.safetensors", "my_sdxl_lightning_4step_unet_merge.safetensors", ""):
        assert recipes.find(spec) is None and recipes.find(spec, lora=True) is None


def test_a_lightning_unet_swap_brings_its_recipe(tmp_path):
    """tiny-pt's UNet under Lightning's 4-step name: trailing spacing in the scheduler config, Euler, 4 steps, no
    CFG as the model's defaults (tiny-pt has no engine_defaults.json), one log line naming the source."""
    unet = tmp_path / "sdxl_lightning_4step_unet.safetensors"
    unet.symlink_to(TINY_PT / "unet" / "diffusion_pytorch_model.safetensors")
    lines = []
    loaded = load_model(str(TINY_PT), unet=str(unet), log=lines.append, **LOAD)
    assert loaded.scheduler_config["timestep_spacing"] == "trailing"
    assert loaded.engine_defaults == {"sampler": "Euler", "num_inference_steps": 4, "guidance_scale": 0.0}
    assert loaded.recipe.name == "SDXL-Lightning 4-step"
    assert any("few-step recipe SDXL-Lightning 4-step (--unet sdxl_lightning_4step_unet)" in line
               and "https://huggingface.co/ByteDance/SDXL-Lightning" in line for line in lines)
    # --timestep-spacing is the deployment's: it wins over the recipe's
    assert load_model(str(TINY_PT), unet=str(unet), timestep_spacing="leading", log=lines.append,
                      **LOAD).scheduler_config["timestep_spacing"] == "leading"
    plain = load_model(str(TINY_PT), **LOAD)
    assert plain.recipe is None and plain.scheduler_config["timestep_spacing"] == "leading"


def test_the_one_step_x0_unet_predicts_the_sample(tmp_path):
    unet = tmp_path / "sdxl_lightning_1step_unet_x0.safetensors"
    unet.symlink_to(TINY_PT / "unet" / "diffusion_pytorch_model.safetensors")
    config = load_model(str(TINY_PT), unet=str(unet), log=lambda _: None, **LOAD).scheduler_config
    assert (config["prediction_type"], config["timestep_spacing"]) == ("sample", "trailing")


def turbo_folder(tmp_path, own_defaults=None):
    """tiny-pt's parts (linked) in a folder named as SDXL-Turbo's hub snapshot is, sdxl-turbo."""
    folder = tmp_path / "sdxl-turbo"
    folder.mkdir()
    for part in TINY_PT.iterdir():
        (folder / part.name).symlink_to(part)
    if own_defaults is not None:
        (folder / ENGINE_DEFAULTS_FILE).write_text(json.dumps(own_defaults))
    return folder


def test_a_turbo_folder_brings_its_size_sampler_steps_and_guidance(tmp_path):
    folder = turbo_folder(tmp_path)
    want = {"sampler": "Euler a", "num_inference_steps": 1, "guidance_scale": 0.0, "width": 512, "height": 512}
    assert engine_defaults(str(folder)) == want  # read before loading (the page's Model choice)
    loaded = load_model(str(folder), log=lambda _: None, **LOAD)
    assert loaded.engine_defaults == want and loaded.scheduler_config["timestep_spacing"] == "trailing"
    config = resolve_defaults(EngineConfig.load(environ={}), loaded.engine_defaults, str(folder))
    assert (config.sampler, config.num_inference_steps, config.guidance_scale, config.width, config.height) == (
        "Euler a", 1, 0.0, 512, 512)
    mine = resolve_defaults(EngineConfig.load({"num_inference_steps": 4, "width": 640}, environ={}),
                            loaded.engine_defaults, str(folder))  # explicit settings win, field by field
    assert (mine.sampler, mine.num_inference_steps, mine.guidance_scale, mine.width, mine.height) == (
        "Euler a", 4, 0.0, 640, 512)


def test_a_folders_own_engine_defaults_win_over_its_names_recipe(tmp_path):
    folder = turbo_folder(tmp_path, {"sampler": "DPM++ 2M", "num_inference_steps": 3})
    lines = []
    loaded = load_model(str(folder), log=lines.append, **LOAD)
    assert engine_defaults(str(folder)) == loaded.engine_defaults == {"sampler": "DPM++ 2M", "num_inference_steps": 3}
    assert loaded.scheduler_config["timestep_spacing"] == "trailing"  # the model's own scheduler field still applies
    assert any("defaults of its engine_defaults.json (kept)" in line for line in lines)


@pytest.mark.slow  # compiles tiny-random at start (about 16 s alone; the parts are tested above)
@pytest.mark.engine
def test_the_engine_runs_a_lightning_unet_with_its_recipe_and_a_setting_or_request_wins(tmp_path):
    """--unet named as Lightning's 2-step UNet (tiny-random's own): requests that leave them out run Euler, 2 steps,
    no CFG, on trailing timesteps, over tiny-random's engine settings; an explicit setting and a request's values
    win. The program runs (4 images) with the recipe's schedule."""
    from sdxl_engine.checkpoint.builtin import model_path
    from sdxl_engine.engine.local import Engine
    from sdxl_engine.engine.validation import GenerateRequest, validate

    unet = tmp_path / "sdxl_lightning_2step_unet.safetensors"
    unet.symlink_to(model_path("tiny-random", os.environ["SDXL_MODEL_CACHE_DIR"]) / "unet"
                    / "diffusion_pytorch_model.safetensors")
    config = EngineConfig.load({"model": "tiny-random", "unet": str(unet), "cpu_devices": 4, "sampler": "DDIM"},
                               environ=CACHES)
    engine = Engine(config, log=lambda _: None).start()
    limits = engine.limits
    assert (limits.default_sampler, limits.default_steps, limits.default_guidance) == ("DDIM", 2, 0.0)  # DDIM: set
    assert engine.planner.schedule("Euler", 2).timesteps.tolist() == [999, 499]  # trailing (leading: 500, 1)
    left_out = engine.generate(GenerateRequest("a red circle", seed=1, sampler="Euler")).request
    assert (left_out.sampler, left_out.num_inference_steps, left_out.guidance_scale) == ("Euler", 2, 0.0)
    asked = validate(GenerateRequest("a red circle", num_inference_steps=6, guidance_scale=3), limits)
    assert (asked.num_inference_steps, asked.guidance_scale) == (6, 3.0)


def test_dmd2s_recipe_steps_as_the_model_cards_custom_timesteps():
    """LCM with the recipe's original_inference_steps 4 has DMD2's timesteps, [999, 749, 499, 249]; that its every step
    is diffusers' LCMScheduler.set_timesteps(timesteps=[999, 749, 499, 249]) (which the fixture tool checked against
    the card's own SDXL config, to the bit) tests/program/test_schedulers.py checks on the lcm-dmd2 case."""
    from sdxl_engine.program.schedulers import make_schedule
    from tests.program.test_schedulers import CASES

    recipe = recipes.find("dmd2_sdxl_4step_unet_fp16.safetensors")
    config = {**CASES["lcm-dmd2"]["resolved"], **recipe.scheduler}
    assert make_schedule("LCM", config, 4).timesteps.tolist() == [999, 749, 499, 249] == CASES["lcm-dmd2"][
        "card_timesteps"] == CASES["lcm-dmd2"]["timesteps"]
    assert CASES["lcm-dmd2"]["changes"] == recipe.scheduler


def test_a_spacing_schedule_type_is_the_class_with_that_spacing_per_request():
    """What a few-step LoRA's recipe sends (its schedule_type): "trailing" on SDXL base's leading config is the
    sampler's schedule from a trailing config (which tests/program/test_schedulers.py checks step by step against
    diffusers: the euler-trailing and ddim-trailing cases); LCM's trailing is DMD2's custom timesteps, the lcm-dmd2
    case's schedule to the bit."""
    from sdxl_engine.program.schedulers import UnsupportedScheduleType, make_schedule
    from tests.program.test_schedulers import CASES, STEPS

    base = STEPS["base_config"]
    trailing = {**base, "timestep_spacing": "trailing"}
    fields = ("timesteps", "sigmas", "a", "b", "c", "d", "e", "init_scale", "final_scale")
    for sampler, steps in (("Euler", 4), ("DDIM", 2), ("Euler a", 3), ("DPM++ 2M", 8)):
        ours, want = make_schedule(sampler, base, steps, "trailing"), make_schedule(sampler, trailing, steps)
        assert all(np.array_equal(getattr(ours, f), getattr(want, f)) for f in fields), sampler
    lcm = make_schedule("LCM", base, 4, "trailing")
    dmd2 = make_schedule("LCM", {**base, **CASES["lcm-dmd2"]["changes"]}, 4)
    assert lcm.timesteps.tolist() == [999, 749, 499, 249]
    assert all(np.array_equal(getattr(lcm, f), getattr(dmd2, f)) for f in fields)
    assert make_schedule("LCM", base, 1, "trailing").timesteps.tolist() == [999]
    with pytest.raises(UnsupportedScheduleType, match="LCM and TCD trailing"):
        make_schedule("LCM", base, 4, "leading")


@pytest.mark.parametrize("name, timestep, alpha_cumprod", [
    ("Hyper-SDXL-1step-Unet.safetensors", 800, 0.036869585514068604),
    ("dmd2_sdxl_1step_unet_fp16.safetensors", 399, 0.4260861277580261)])
def test_a_one_step_unets_recipe_runs_the_cards_timestep(tmp_path, name, timestep, alpha_cumprod):
    """The cards' ``timesteps=[800]`` / ``[399]``: the recipe's custom_timesteps in the scheduler config, which LCM and
    TCD run at its one step (automatic); other step counts, schedule types and samplers keep their own. The sigma is
    diffusers 0.42.1's: LCMScheduler.from_config(SDXL base's config).set_timesteps(timesteps=[t]), alphas_cumprod[t]
    (the literals, printed by it)."""
    from sdxl_engine.program.schedulers import make_schedule

    unet = tmp_path / name
    unet.symlink_to(TINY_PT / "unet" / "diffusion_pytorch_model.safetensors")
    config = load_model(str(TINY_PT), unet=str(unet), **LOAD).scheduler_config
    assert config["custom_timesteps"] == [timestep]
    for sampler in ("LCM", "TCD"):
        one = make_schedule(sampler, config, 1)
        assert one.timesteps.tolist() == [timestep]
        np.testing.assert_allclose(one.sigmas[0], ((1 - alpha_cumprod) / alpha_cumprod) ** 0.5, rtol=1e-6)
        assert make_schedule(sampler, config, 1, "trailing").timesteps.tolist() == [999]
    plain = {k: v for k, v in config.items() if k != "custom_timesteps"}
    for sampler, steps in (("LCM", 2), ("TCD", 2), ("Euler", 1), ("DDIM", 1)):
        assert make_schedule(sampler, config, steps).timesteps.tolist() == make_schedule(
            sampler, plain, steps).timesteps.tolist() != [timestep]


@pytest.mark.parametrize("custom", [[800, 900], [1000], [-1], [800.5], [], "800"])
def test_custom_timesteps_that_are_not_falling_whole_training_timesteps_stop_the_model(custom):
    from sdxl_engine.checkpoint.builtin import SDXL_SCHEDULER
    from sdxl_engine.program.schedulers import UnsupportedSchedulerConfig, check_scheduler_config

    with pytest.raises(UnsupportedSchedulerConfig, match="custom_timesteps=.* a list of whole timesteps, largest "
                                                         "first, each at least 0 and below num_train_timesteps"):
        check_scheduler_config({**SDXL_SCHEDULER, "custom_timesteps": custom})
