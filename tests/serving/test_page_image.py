"""The "Image to image" section's settings that need no browser (serving/page_image.py); the section in a browser:
tests/serving/test_page_browser.py."""

import threading
from types import SimpleNamespace

from sdxl_engine.serving.page_image import brush_radius, editor_tools


def engine_of(default_size: tuple[int, int]):
    """What size_choices reads of an engine that is ready: its limits' sizes and default size."""
    ready = threading.Event()
    ready.set()
    return SimpleNamespace(ready=ready, error=None,
                           limits=SimpleNamespace(default_size=default_size, sizes=(default_size,)))


def test_the_brush_is_a_sixteenth_of_the_models_shorter_side():
    """Gradio's "auto" brush is a fixed 25 px radius (about 80 % of a 64 x 64 picture); here it follows the model's
    size: tiny-shapes' 64 -> 4 px, SDXL's 1024 -> 64 px, a portrait default by its shorter side (832 x 1216 -> 52)."""
    assert [brush_radius(engine_of(size)) for size in ((64, 64), (1024, 1024), (832, 1216), (16, 8))] == [4, 64, 52, 1]
    assert brush_radius(None) is None  # before the engine is ready: the page's refresh sets it then
    tools = editor_tools(engine_of((1216, 832)))
    assert tools["brush"].default_size == 52 and tools["eraser"].default_size == 52
    assert tools["brush"].colors == ["#000000"] and tools["brush"].color_mode == "fixed"  # gr.ImageMask's own brush
    assert editor_tools(None)["brush"].default_size == "auto"
