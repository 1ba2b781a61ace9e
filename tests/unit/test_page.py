"""The page builder driven by a fake engine (no app process, no compile)."""



def test_page_builder_with_fake_engine():
    """The page can be driven by any callable with the /generate signature (no model)."""
    import app
    from sdxl_engine.config import EngineConfig

    seen = []

    def fake(*values, progress=None, arrived=None):
        seen.append(values)
        return [], {}, None

    demo = app.build_demo(fake, EngineConfig.load(environ={}))
    api = demo.get_api_info()["named_endpoints"]["/generate"]
    names = [p["parameter_name"] for p in api["parameters"]]
    # The first seven are the /generate contract; later inputs are optional additions.
    assert names[:7] == ["prompt", "negative_prompt", "seed", "guidance_scale", "num_inference_steps", "width", "height"]
    assert names[7:] == ["style", "sampler"] and api["parameters"][7]["parameter_has_default"]
    assert [p["parameter_has_default"] for p in api["parameters"]] == [False] + [True] * 8
    assert api["parameters"][8]["python_type"]["type"] == "Literal['Euler', 'Euler a', 'DPM++ 2M', 'DPM++ 2M Karras', 'DDIM', 'LCM']"
    assert len(api["returns"]) == 2  # the gallery and the JSON info (the history record never leaves the server)
    # What view_api shows: whole numbers as int (a slider reports float unless told otherwise).
    assert [p["python_type"]["type"] for p in api["parameters"][:7]] == ["str", "str", "int", "float", "int", "int",
                                                                          "int"]


def test_page_lists_the_loras_and_a_click_adds_a_tag(tmp_path):
    """(#21) The page lists the configured LoRAs (names from --lora and --lora-dir, in that order); a click
    appends ``<lora:NAME:1>`` to the prompt; an index the page never sends is refused in one line."""
    import gradio as gr
    import pytest

    import app
    from sdxl_engine.config import EngineConfig
    from tests.helpers import FIXTURES

    (tmp_path / "ink.safetensors").write_bytes(b"")
    config = EngineConfig.load({"lora": f"peft={FIXTURES / 'tiny-pt-lora' / 'peft.safetensors'}",
                                "lora_dir": str(tmp_path)}, environ={})
    demo = app.build_demo(lambda *v, **kw: ([], {}, None), config)
    listing = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "loras")
    # the deployment's (--lora, then --lora-dir), then tiny-shapes' own LCM-LoRA (#26, its loras.json)
    assert listing.visible and [s[0] for s in listing.samples] == ["<lora:peft:1>", "<lora:ink:1>", "<lora:lcm:1>"]
    add = next(f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "add_lora")
    assert add(1, "a red circle ") == "a red circle <lora:ink:1>"
    assert add(0, "") == add(0, None) == "<lora:peft:1>"
    with pytest.raises(gr.Error):
        add(3, "x")
    shipped = app.build_demo(lambda *v, **kw: ([], {}, None), EngineConfig.load(environ={}))
    assert [s[0] for s in next(b for b in shipped.blocks.values() if getattr(b, "elem_id", None) == "loras").samples
            ] == ["<lora:lcm:1>"]
    plain = app.build_demo(lambda *v, **kw: ([], {}, None), EngineConfig.load({"model": "tiny-random"}, environ={}))
    assert not next(b for b in plain.blocks.values() if getattr(b, "elem_id", None) == "loras").visible
