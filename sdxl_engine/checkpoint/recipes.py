"""Few-step models' recipes: the sampler, steps, guidance, size and scheduler fields their model cards prescribe.

SDXL-Lightning, Hyper-SD, DMD2 and SDXL-Turbo are distilled to run in 1-8 steps, without classifier-free guidance,
at the timesteps they were trained on; run with SDXL's defaults (Euler, 20 steps, guidance 5, "leading" spacing)
they give grey or burnt images. Their files declare nothing of this (no field in a UNet's config or a LoRA says
"Lightning, 4 steps"): what they are is in their published names, which the model cards tell users to keep ("Use
the correct ckpt for your step setting!"). So a recipe is keyed by the name of the file or folder it is read from
(:func:`find`): the ``--unet`` file, the model's folder, single file or hub id, or a LoRA's file.

A recipe has two parts:

* ``defaults``: what a request that leaves them out runs with, in ``engine_defaults.json``'s form (keys of
  ``config.MODEL_DEFAULT_FIELDS``). They stand where a model folder has no ``engine_defaults.json`` of its own;
  a deployment's explicit settings and a request's values win, as over any model's defaults (config.py).
* ``scheduler``: scheduler config fields set as the model card's ``<Scheduler>.from_config(config, **fields)``
  sets them (``timestep_spacing``, ``prediction_type``, LCM's ``original_inference_steps``): they describe the
  model itself, so they apply to every sampler a request picks; ``--timestep-spacing`` still wins.

A LoRA's recipe (``lora=True``) has no scheduler part: a LoRA is chosen per request (its tag), so its spacing is
the request's ``schedule_type`` (docs/samplers.md), which its preset on the page sets.

Every value below is quoted from the model card it comes from (``source``); docs/few-step.md lists them.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import PurePosixPath

__all__ = ["Recipe", "RECIPES", "find", "name_of"]

LIGHTNING = "https://huggingface.co/ByteDance/SDXL-Lightning"
HYPER = "https://huggingface.co/ByteDance/Hyper-SD"
DMD2 = "https://huggingface.co/tianweiy/DMD2"
TURBO = "https://huggingface.co/stabilityai/sdxl-turbo"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One few-step model's settings, from its model card.

    Attributes:
        name: what it is, as logs and the page name it ("SDXL-Lightning 4-step").
        pattern: a regular expression, matched case-insensitively against the whole name of a file (without its
            extension) or folder (:func:`name_of`); ``{n}`` in ``name`` is the pattern's ``n`` group.
        defaults: engine_defaults.json's form: sampler, num_inference_steps, guidance_scale, and width/height where
            the card names a size; plus ``schedule_type`` for a LoRA (the per-request spacing of its preset).
        scheduler: scheduler config fields the card sets with ``from_config`` (a model's recipe only).
        lora: a LoRA's recipe (matched against LoRA files only), else a model's or a UNet's.
        source: the model card's address and the words or code the values come from.
        note: where the engine runs something other than the card's recipe, and why ("" = the card's own).
    """

    name: str
    pattern: str
    defaults: dict
    scheduler: dict = dataclasses.field(default_factory=dict)
    lora: bool = False
    source: str = ""
    note: str = ""

    def steps_for(self, match: re.Match) -> Recipe:
        """This recipe with its ``{n}`` (name) and ``"n"`` (steps) filled in from ``match``'s step group."""
        if "n" not in match.groupdict():
            return self
        n = int(match.group("n"))
        defaults = {k: n if v == "n" else v for k, v in self.defaults.items()}
        return dataclasses.replace(self, name=self.name.format(n=n), defaults=defaults)

    def engine_defaults(self) -> dict:
        """A model's ``defaults`` as read from an engine_defaults.json (config.MODEL_DEFAULT_FIELDS keys)."""
        return dict(self.defaults)

    def as_file(self) -> dict:
        """``defaults`` as an engine_defaults.json file would hold them, with a ``_source`` note (docs/few-step.md)."""
        return {"_source": f"few-step recipe {self.name}: {self.source}", **self.defaults}


_NO_CFG = {"guidance_scale": 0.0}

# The recipes, first match wins. Steps "n" come from the name's step count.
RECIPES = (
    # SDXL-Lightning: "Ensure sampler uses "trailing" timesteps." pipe.scheduler = EulerDiscreteScheduler.from_config(
    # pipe.scheduler.config, timestep_spacing="trailing"); "Ensure using the same inference steps as the loaded model
    # and CFG set to 0." pipe("...", num_inference_steps=4, guidance_scale=0). The 1-step model: "uses "sample"
    # prediction instead of "epsilon" prediction" (..., timestep_spacing="trailing", prediction_type="sample").
    Recipe("SDXL-Lightning 1-step (x0)", r"sdxl_lightning_1step(_unet)?_x0",
           {"sampler": "Euler", "num_inference_steps": 1, **_NO_CFG},
           {"timestep_spacing": "trailing", "prediction_type": "sample"},
           source=f"{LIGHTNING}: EulerDiscreteScheduler.from_config(..., timestep_spacing=\"trailing\", "
                  "prediction_type=\"sample\"), num_inference_steps=1, guidance_scale=0"),
    Recipe("SDXL-Lightning {n}-step LoRA", r"sdxl_lightning_(?P<n>[248])step_lora",
           {"sampler": "Euler", "num_inference_steps": "n", **_NO_CFG, "schedule_type": "trailing"}, lora=True,
           source=f"{LIGHTNING}: load_lora_weights(sdxl_lightning_4step_lora), EulerDiscreteScheduler.from_config("
                  "..., timestep_spacing=\"trailing\"), the model's steps, guidance_scale=0"),
    Recipe("SDXL-Lightning {n}-step", r"sdxl_lightning_(?P<n>[248])step(_unet)?",
           {"sampler": "Euler", "num_inference_steps": "n", **_NO_CFG}, {"timestep_spacing": "trailing"},
           source=f"{LIGHTNING}: \"Ensure sampler uses 'trailing' timesteps\" (EulerDiscreteScheduler, "
                  "timestep_spacing=\"trailing\"); \"the same inference steps as the loaded model and CFG set to 0\""),
    # Hyper-SD, SDXL: "Ensure ddim scheduler timestep spacing set as trailing !!!" pipe.scheduler =
    # DDIMScheduler.from_config(pipe.scheduler.config, timestep_spacing="trailing"), num_inference_steps=2,
    # guidance_scale=0 (2/4/8-steps LoRAs); the CFG-preserved ones: guidance_scale=5.0 "we recommend 5~8".
    Recipe("Hyper-SDXL {n}-step CFG LoRA", r"hyper-sdxl-(?P<n>8|12)steps-cfg-lora",
           {"sampler": "DDIM", "num_inference_steps": "n", "guidance_scale": 5.0, "schedule_type": "trailing"},
           lora=True, source=f"{HYPER}: DDIMScheduler.from_config(..., timestep_spacing=\"trailing\"), "
                             "guidance_scale = 5.0 (\"we recommend 5~8\")"),
    Recipe("Hyper-SDXL {n}-step LoRA", r"hyper-sdxl-(?P<n>[248])steps?-lora",
           {"sampler": "DDIM", "num_inference_steps": "n", **_NO_CFG, "schedule_type": "trailing"}, lora=True,
           source=f"{HYPER}: \"Ensure ddim scheduler timestep spacing set as trailing !!!\" DDIMScheduler.from_config("
                  "..., timestep_spacing=\"trailing\"), guidance_scale=0"),
    # The unified 1-step LoRA: pipe.scheduler = TCDScheduler.from_config(pipe.scheduler.config), num_inference_steps=1,
    # guidance_scale=0, eta=1.0. The engine's TCD runs gamma 0.3, which at one step is the card's eta 1.0 (the one
    # step goes to timestep 0 whatever gamma); TCD's own timesteps (automatic: from_config, no timesteps), [999].
    Recipe("Hyper-SDXL 1-step LoRA", r"hyper-sdxl-1step-lora",
           {"sampler": "TCD", "num_inference_steps": 1, **_NO_CFG, "schedule_type": "automatic"}, lora=True,
           source=f"{HYPER}: TCDScheduler.from_config(...), num_inference_steps=1, guidance_scale=0, eta=1.0"),
    # The 1-step UNet: LCMScheduler, "Set start timesteps to 800 in the one-step inference", timesteps=[800]: the
    # scheduler config's custom_timesteps (program/schedulers.py), which LCM and TCD run at 1 step (automatic).
    Recipe("Hyper-SDXL 1-step UNet", r"hyper-sdxl-1step-unet(-comfyui)?(\.fp16)?",
           {"sampler": "LCM", "num_inference_steps": 1, **_NO_CFG}, {"custom_timesteps": [800]},
           source=f"{HYPER}: LCMScheduler.from_config(...), num_inference_steps=1, guidance_scale=0, timesteps=[800]"),
    # DMD2: pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config); "LCMScheduler's default timesteps are
    # different from the one we used for training": pipe(..., num_inference_steps=4, guidance_scale=0,
    # timesteps=[999, 749, 499, 249]). LCMScheduler with original_inference_steps=4 has exactly those at 4 steps
    # (k = 1000 // 4 = 250: 250 i - 1), so the scheduler field is that; the LoRA's are the "trailing" schedule type.
    Recipe("DMD2 4-step LoRA", r"dmd2_sdxl_4step_lora(_fp16)?",
           {"sampler": "LCM", "num_inference_steps": 4, **_NO_CFG, "schedule_type": "trailing"}, lora=True,
           source=f"{DMD2}: LCMScheduler, num_inference_steps=4, guidance_scale=0, timesteps=[999, 749, 499, 249]"),
    Recipe("DMD2 4-step", r"dmd2_sdxl_4step_unet(_fp16)?",
           {"sampler": "LCM", "num_inference_steps": 4, **_NO_CFG}, {"original_inference_steps": 4},
           source=f"{DMD2}: LCMScheduler, num_inference_steps=4, guidance_scale=0, timesteps=[999, 749, 499, 249]"),
    # DMD2's 1-step UNet: the same LCMScheduler, pipe(..., num_inference_steps=1, guidance_scale=0, timesteps=[399]).
    Recipe("DMD2 1-step", r"dmd2_sdxl_1step_unet(_fp16)?",
           {"sampler": "LCM", "num_inference_steps": 1, **_NO_CFG}, {"custom_timesteps": [399]},
           source=f"{DMD2}: LCMScheduler, num_inference_steps=1, guidance_scale=0, timesteps=[399]"),
    # SDXL-Turbo: "SDXL-Turbo does not make use of guidance_scale or negative_prompt, we disable it with
    # guidance_scale=0.0. Preferably, the model generates images of size 512x512 ... A single step is enough";
    # pipe(prompt=prompt, num_inference_steps=1, guidance_scale=0.0). Its scheduler_config.json is
    # EulerAncestralDiscreteScheduler with timestep_spacing "trailing" (its single file has no config: the field).
    Recipe("SDXL-Turbo", r"(stabilityai--)?(sdxl-turbo|sd_xl_turbo_1\.0(_fp16)?)",
           {"sampler": "Euler a", "num_inference_steps": 1, **_NO_CFG, "width": 512, "height": 512},
           {"timestep_spacing": "trailing"},
           source=f"{TURBO}: \"we disable it with guidance_scale=0.0. Preferably, the model generates images of size "
                  "512x512\"; num_inference_steps=1; its scheduler: EulerAncestralDiscreteScheduler, trailing"),
)


def name_of(spec: str) -> str:
    """The name a recipe is matched against: a path's, hub id's or hub file's last part without its extension
    (``ByteDance/SDXL-Lightning/sdxl_lightning_4step_unet.safetensors`` -> ``sdxl_lightning_4step_unet``)."""
    last = PurePosixPath(str(spec).replace("\\", "/").rstrip("/")).name
    for suffix in (".safetensors", ".bin", ".ckpt", ".pt"):
        if last.lower().endswith(suffix):
            return last[: -len(suffix)]
    return last


def find(spec: str, lora: bool = False) -> Recipe | None:
    """The recipe of the file, folder or hub id ``spec`` (a LoRA's with ``lora``), its steps filled in; None for
    a name no recipe matches (every other model: SDXL's defaults)."""
    if not spec:
        return None
    name = name_of(spec)
    for recipe in RECIPES:
        match = re.fullmatch(recipe.pattern, name, re.IGNORECASE)
        if match and recipe.lora == lora:
            return recipe.steps_for(match)
    return None
