"""A request tagging a few-step LoRA (Lightning's, Hyper-SD's, DMD2's by their files' names) runs that LoRA's recipe
for what it leaves out: what an A1111 or API client that sends only a prompt with the tag gets."""

from sdxl_engine.engine.local import lora_recipes
from sdxl_engine.engine.validation import GenerateRequest, Limits, validate

SOURCES = {"light": "/loras/sdxl_lightning_4step_lora.safetensors", "ink": "/loras/ink.safetensors",
           "dmd": "/loras/dmd2_sdxl_4step_lora_fp16.safetensors"}


def limits() -> Limits:
    lines = []
    found = lora_recipes(SOURCES, ("light", "ink", "dmd"), lines.append)
    assert [name for name, _ in found] == ["light", "dmd"] and len(lines) == 2
    return Limits(max_seed=100, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=8,
                  default_guidance=5.0, default_sampler="DPM++ 2M", loras=("light", "ink", "dmd"), lora_recipes=found)


def test_a_tagged_few_step_lora_brings_its_recipe_for_what_the_request_leaves_out():
    checked = validate(GenerateRequest("a cat <lora:light:1>", seed=1), limits())
    assert (checked.sampler, checked.num_inference_steps, checked.guidance_scale, checked.schedule_type) == (
        "Euler", 4, 0.0, "trailing")
    dmd = validate(GenerateRequest("<lora:ink:0.5> a cat <lora:dmd:1>", seed=1), limits())
    assert (dmd.sampler, dmd.num_inference_steps, dmd.guidance_scale, dmd.schedule_type) == ("LCM", 4, 0.0,
                                                                                            "trailing")


def test_the_requests_own_values_win_and_an_untagged_prompt_runs_the_models_defaults():
    mine = validate(GenerateRequest("a cat <lora:light:1>", seed=1, num_inference_steps=8, guidance_scale=1.5),
                    limits())
    assert (mine.sampler, mine.num_inference_steps, mine.guidance_scale, mine.schedule_type) == (
        "Euler", 8, 1.5, "trailing")
    # a sampler of the request's own: the recipe's schedule type goes with the recipe's sampler, so automatic
    other = validate(GenerateRequest("a cat <lora:light:1>", seed=1, sampler="DPM++ 2M Karras"), limits())
    assert (other.sampler, other.num_inference_steps, other.schedule_type) == ("DPM++ 2M Karras", 4, "automatic")
    plain = validate(GenerateRequest("a cat <lora:ink:1>", seed=1), limits())
    assert (plain.sampler, plain.num_inference_steps, plain.guidance_scale, plain.schedule_type) == (
        "DPM++ 2M", 8, 5.0, "automatic")
