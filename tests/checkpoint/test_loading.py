"""Loading without a compile: the built-in tokenizer's vocabulary, a missing model folder."""

import pytest

from sdxl_engine.checkpoint.builtin import build_vocab
from sdxl_engine.checkpoint.loading import ModelLoadError, load_model


def test_tokenizer_vocabulary_is_the_projects():
    vocab, merges = build_vocab()
    assert list(vocab)[-2:] == ["<|startoftext|>", "<|endoftext|>"]  # end token has the largest id
    for word in ("red", "circle", "square", "blue"):
        assert word + "</w>" in vocab


def test_missing_model_directory_gives_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a built-in name, an existing directory nor a hub id"):
        load_model(str(tmp_path / "nope"), dtype="auto", platform="cpu", cache_dir=str(tmp_path))
    with pytest.raises(ModelLoadError, match="no model_index.json"):
        load_model(str(tmp_path), dtype="auto", platform="cpu", cache_dir=str(tmp_path))


def test_a_refiner_that_does_not_load_is_named_by_its_setting(tmp_path):
    """The refiner loads through load_model too: its errors name --refiner and the refiner's weights, never
    --model and the base's (issue #47: `app.py --refiner nonexistent` told the user to fix --model)."""
    (tmp_path / "refiner.ckpt").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    hint = "use the hub id (--refiner stabilityai/stable-diffusion-xl-refiner-1.0)"
    cases = [("nonexistent", "", "--refiner 'nonexistent' is neither a built-in name, an existing directory nor "
                                 "a hub id. Real SDXL needs its weights: on a machine that reaches the Hugging Face "
                                 "Hub " + hint),
             (str(tmp_path / "empty"), "", f"--refiner {tmp_path / 'empty'}: not a diffusers-format model"),
             (str(tmp_path / "refiner.ckpt"), "", "single files load: --refiner FILE.safetensors"),
             ("./missing.safetensors", "", "--refiner ./missing.safetensors: no such file"),
             ("sdxl-base-random", str(tmp_path), "--refiner-config apply to models read from files")]
    for refiner, refiner_config, expected in cases:
        with pytest.raises(ModelLoadError) as err:
            load_model(refiner, dtype="auto", platform="cpu", cache_dir=str(tmp_path), flag="--refiner",
                       model_config=refiner_config)
        assert expected in str(err.value) and "--model" not in str(err.value), str(err.value)


# ---- what a model's files declare (ModelKind): a refiner and an inpainting UNet load as what they are ----
import json  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402

from sdxl_engine.checkpoint.loading import ModelKind, load_folder, read_model_kind  # noqa: E402
from sdxl_engine.checkpoint.writing import save_params  # noqa: E402
from sdxl_engine.models import build_component  # noqa: E402
from tests.helpers import FIXTURES  # noqa: E402

TINY_PT = FIXTURES / "tiny-pt"


def variant_of_tiny_pt(tmp_path, index_changes: dict, unet_changes: dict, drop_text_encoder: bool = False):
    """tiny-pt (base: two encoders of hidden 32 + 48, addition_time_embed_dim 8, projection 48) with its
    model_index.json and unet config changed; the UNet's weights made anew for its new shapes."""
    folder = tmp_path / "model"
    shutil.copytree(TINY_PT, folder)
    index = {**json.loads((folder / "model_index.json").read_text()), **index_changes}
    (folder / "model_index.json").write_text(json.dumps(index))
    if drop_text_encoder:
        shutil.rmtree(folder / "text_encoder")
        shutil.rmtree(folder / "tokenizer")
    config = {**json.loads((folder / "unet" / "config.json").read_text()), **unet_changes}
    (folder / "unet" / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)  # weights by shape: the test reads kinds and shapes, not images
    save_params({k: rng.standard_normal(shape, np.float32) * 0.02 for k, shape in
                 build_component("unet", config).shapes.items()},
                folder / "unet" / "diffusion_pytorch_model.safetensors")
    return folder


def refiner(tmp_path):
    """As stabilityai/stable-diffusion-xl-refiner-1.0 declares itself: the img2img pipeline, text_encoder_2
    only, 5 time ids (the aesthetic score), requires_aesthetics_score, no force-zero."""
    return variant_of_tiny_pt(tmp_path, {"_class_name": "StableDiffusionXLImg2ImgPipeline",
                                         "text_encoder": [None, None], "tokenizer": [None, None],
                                         "requires_aesthetics_score": True, "force_zeros_for_empty_prompt": False},
                              {"cross_attention_dim": 48, "projection_class_embeddings_input_dim": 5 * 8 + 48},
                              drop_text_encoder=True)


def test_a_base_model_is_what_the_engine_serves():
    kind = read_model_kind(TINY_PT)
    assert kind == ModelKind() and kind.txt2img_refusal("tiny-pt") is None
    assert (kind.text_encoders, kind.time_ids, kind.unet_in_channels, kind.refiner, kind.inpainting_unet) == (
        ("text_encoder", "text_encoder_2"), 6, 4, False, False)


def test_a_refiner_folder_loads_with_one_text_encoder_and_five_time_ids(tmp_path):
    model = load_folder(refiner(tmp_path), "refiner", "float32")
    assert model.kind == ModelKind(text_encoders=("text_encoder_2",), time_ids=5, requires_aesthetics_score=True,
                                   force_zeros_for_empty_prompt=False)
    assert set(model.components) == set(model.params) == {"text_encoder_2", "unet", "vae"}
    assert model.tokenizer is None and model.tokenizer_2 is not None and model.kind.refiner
    assert model.kind.txt2img_refusal("refiner") == (
        "refiner is an SDXL refiner (text_encoder_2, 5 time ids with an aesthetic score): it refines another "
        "model's images and cannot make images from text; serve an SDXL base model (for example --model "
        "stabilityai/stable-diffusion-xl-base-1.0) with refiner as --refiner")


def test_a_nine_channel_inpainting_unet_loads(tmp_path):
    folder = variant_of_tiny_pt(tmp_path, {"_class_name": "StableDiffusionXLInpaintPipeline"}, {"in_channels": 9})
    model = load_folder(folder, "inpaint", "float32")
    assert (model.kind.unet_in_channels, model.kind.latent_channels, model.latent_channels) == (9, 4, 4)
    assert model.kind.inpainting_unet and not model.kind.refiner
    assert model.params["unet"]["conv_in.weight"].shape[2] == 9  # (kh, kw, in, out): the modules' layout
    assert model.kind.txt2img_refusal("inpaint").startswith(
        "inpaint has an inpainting UNet (9 input channels: latents, mask and masked-image latents)")


@pytest.mark.parametrize("unet_changes, message", [
    ({"in_channels": 5}, r"unet in_channels 5 must be the vae's latent_channels 4 \(or 9 for an inpainting UNet"),
    ({"projection_class_embeddings_input_dim": 4 * 8 + 48},
     r"must be 6 x addition_time_embed_dim \+ text_encoder_2 projection_dim = 96 \(a refiner: 5 x ... = 88\)"),
])
def test_components_that_fit_no_sdxl_kind_are_refused(tmp_path, unet_changes, message):
    with pytest.raises(ModelLoadError, match=message):
        read_model_kind(variant_of_tiny_pt(tmp_path, {}, unet_changes))


def test_a_refiners_unet_must_fit_its_one_text_encoder(tmp_path):
    folder = refiner(tmp_path)
    config = json.loads((folder / "unet" / "config.json").read_text())
    (folder / "unet" / "config.json").write_text(json.dumps({**config, "cross_attention_dim": 80}))
    with pytest.raises(ModelLoadError, match=r"unet cross_attention_dim \(80, 80, 80\) must equal text_encoder_2's "
                                             r"hidden size \(48\), the one text encoder of a refiner"):
        read_model_kind(folder)


def test_the_engine_refuses_to_serve_a_refiner_with_one_line(tmp_path):
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    engine = Engine(EngineConfig.load({"model": str(refiner(tmp_path)), "cpu_devices": 4}, environ={}),
                    log=lambda *_: None)
    with pytest.raises(ModelLoadError, match=r"^model is an SDXL refiner \(text_encoder_2, 5 time ids") as err:
        engine.start()
    assert "\n" not in str(err.value) and engine.error is err.value and engine.ready.is_set()


def test_an_unreachable_hub_is_one_error_line_without_retries(monkeypatch):
    """huggingface_hub retries a failed connection 5 times over ~25 s, logging each; one connection attempt
    tells first, so the start ends with its one error line at once."""
    from huggingface_hub import HfApi

    from sdxl_engine.checkpoint import loading

    asked = []

    class ClosedHub(HfApi):
        def __init__(self):
            super().__init__(endpoint="http://127.0.0.1:9")  # the discard port: nothing listens

        def list_repo_files(self, *args, **kwargs):
            asked.append(args)
            return super().list_repo_files(*args, **kwargs)

    for name in loading.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(loading, "HfApi", ClosedHub)
    with pytest.raises(ModelLoadError, match=r"^could not load SDXL model 'owner/not-cached' from the hub "
                                             r"\(ConnectionError: cannot reach 127.0.0.1:9: Connection refused\)"):
        loading.hub_snapshot("owner/not-cached")
    assert asked == []  # the hub client (and its retries) never ran
    assert loading.hub_unreachable("http://127.0.0.1:9") == "cannot reach 127.0.0.1:9: Connection refused"
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert loading.hub_unreachable("http://127.0.0.1:9") is None  # behind a proxy only a request can tell
