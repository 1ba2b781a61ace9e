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
    assert api["parameters"][8]["python_type"]["type"] == "Literal['Euler', 'Euler a', 'DPM++ 2M', 'DPM++ 2M Karras', 'DDIM']"
    assert len(api["returns"]) == 2  # the gallery and the JSON info (the history record never leaves the server)
    # What view_api shows: whole numbers as int (a slider reports float unless told otherwise).
    assert [p["python_type"]["type"] for p in api["parameters"][:7]] == ["str", "str", "int", "float", "int", "int",
                                                                          "int"]
