"""The page's "Fast (LCM, 4 steps)" preset and the way back to the model's and the blog's settings."""

import pytest

from sdxl_engine.config import EngineConfig


@pytest.fixture(scope="module")
def page():
    import app
    from sdxl_engine.serving import handler

    config = handler.page_defaults(EngineConfig.load(environ={}))
    return app, config, app.build_demo(lambda *values, **kw: ([], {}, None), config)


def event_of(demo, elem_id, n=0):
    button = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == elem_id)
    events = [fn for fn in demo.fns.values() if any(t[0] == button._id for t in fn.targets)]
    return button, events[n]


def outputs(event):
    return [getattr(block, "elem_id", None) or getattr(block, "label", None) for block in event.outputs]


def test_fast_preset_adds_the_lcm_tag_once_and_sets_lcm_4_steps_no_cfg(page):
    app, config, demo = page
    button, event = event_of(demo, "fast-preset")
    assert button.value == "Fast (LCM, 4 steps)" and button.visible  # tiny-shapes ships a LoRA named "lcm"
    assert outputs(event)[:2] == ["sampler", "steps"] and outputs(event)[3:] == ["prompt", "schedule-type"]
    # LCM takes no schedule type but its own: the preset puts the dropdown back to Automatic
    assert event.fn("a red circle") == ("LCM", 4, 1.0, "a red circle <lora:lcm:1>", "Automatic")
    assert event.fn("a red circle <lora:lcm:0.5>")[3] == "a red circle <lora:lcm:1>"  # one tag, weight 1
    assert event.fn("")[3] == "<lora:lcm:1>"
    assert event.fn("<lora:ink:1> a star")[3] == "<lora:ink:1> a star <lora:lcm:1>"  # other tags stay


def test_model_default_and_blog_default_take_the_lcm_tag_away(page):
    app, config, demo = page
    button, event = event_of(demo, "model-default")
    assert button.value == f"Model default ({config.sampler}, {config.num_inference_steps} steps)" == \
        "Model default (Euler, 8 steps)"
    # no engine: the page's resolved defaults (the default model's), whatever the Model dropdown says
    assert event.fn("tiny-shapes", "a red circle <lora:lcm:1>") == ("Euler", 8, 5.0, "a red circle")
    _, first = event_of(demo, "blog-default", 0)
    _, second = event_of(demo, "blog-default", 1)
    assert first.fn() == ("Euler", 20, "Automatic")
    assert second.fn("a red circle <LORA:lcm:1>") == ("a red circle", 5.0)
    untouched = second.fn("a red circle")  # without the fast tag, the prompt and the guidance stay as they are
    assert all(isinstance(u, dict) and set(u) <= {"__type__"} for u in untouched)


def test_no_lcm_lora_no_fast_button(tmp_path):
    import app
    from sdxl_engine.serving import handler

    config = handler.page_defaults(EngineConfig.load({"model": "tiny-random"}, environ={}))
    demo = app.build_demo(lambda *values, **kw: ([], {}, None), config)
    button, _ = event_of(demo, "fast-preset")
    assert not button.visible


def test_a_few_step_loras_recipe_is_the_fast_preset(tmp_path):
    """A LoRA whose file is named as SDXL-Lightning's 4-step LoRA (tiny-shapes' LCM-LoRA under that name): the
    button names its recipe and sets Euler, 4 steps, no CFG, the trailing schedule type, and its tag; Blog default
    takes that tag away (checkpoint/recipes.py)."""
    import app
    from sdxl_engine.checkpoint.builtin import TINY_SHAPES_DIR
    from sdxl_engine.serving import handler

    lora = tmp_path / "sdxl_lightning_4step_lora.safetensors"
    lora.symlink_to(TINY_SHAPES_DIR / "lcm-lora.safetensors")
    config = handler.page_defaults(EngineConfig.load({"lora": f"light={lora}"}, environ={}))
    demo = app.build_demo(lambda *values, **kw: ([], {}, None), config)
    button, event = event_of(demo, "fast-preset")
    assert button.value == "Fast (SDXL-Lightning 4-step LoRA: Euler, 4 steps)" and button.visible
    assert event.fn("a red circle") == ("Euler", 4, 0.0, "a red circle <lora:light:1>", "Trailing")
    _, second = event_of(demo, "blog-default", 1)
    assert second.fn("a red circle <lora:light:1>") == ("a red circle", 5.0)
