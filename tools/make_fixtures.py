"""PyTorch reference fixtures for the project's own Flax NNX modules (diffusers is the reference).

Commands, run from the repository root (each in the module that makes it):

    python -m tools.make_fixtures tiny                # tools/fixtures_tiny.py
    python -m tools.make_fixtures keys                # tools/fixtures_tiny.py
    python -m tools.make_fixtures samplers            # tools/fixtures_samplers.py
    python -m tools.make_fixtures two-call-samplers   # tools/fixtures_two_calls.py
    python -m tools.make_fixtures tcd                 # tools/fixtures_tcd.py (tools.lcm_noise first)
    python -m tools.make_fixtures ddim-eta            # tools/fixtures_ddim_eta.py
    python -m tools.make_fixtures restart             # tools/fixtures_restart.py (tools.restart_noise first)
    python -m tools.make_fixtures single              # tools/fixtures_single.py
    python -m tools.make_fixtures sgm-keys            # tools/fixtures_single.py
    python -m tools.make_fixtures single-fullsize --out FILE [--dtype float16|float32]
    python -m tools.make_fixtures lora                # tools/fixtures_lora.py
    python -m tools.make_fixtures single-lora         # tools/fixtures_single.py
    python -m tools.make_fixtures lcm-lora            # tools/fixtures_lora.py
    python -m tools.make_fixtures img2img             # tools/fixtures_img2img.py
    python -m tools.make_fixtures ip-adapter          # tools/fixtures_ip_adapter.py
    python -m tools.make_fixtures ip-adapter-faceid   # tools/fixtures_ip_adapter_faceid.py
    python -m tools.make_fixtures controlnet-union    # tools/fixtures_controlnet_union.py
    python -m tools.make_fixtures fullsize --out DIR [--dtype float32|bfloat16]   # tools/fixtures_fullsize.py

What they share (paths, SDXL base's configs, building and checking components, writers) is
tools/fixtures_common.py; tests/fixtures/README.md says what each fixture holds.

It needs PyTorch and the reference libraries, which the runtime and CI never install:
``pip install torch==2.13.0 diffusers==0.42.1 transformers==5.24.0 safetensors accelerate`` (and ``torchsde`` for
``two-call-samplers``: diffusers imports DPMSolverSDEScheduler through it).
It is never run in CI; the runtime and the tests never import it (the tests read its output).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import diffusers
import transformers

from tools.fixtures_common import FIXTURES
from tools.fixtures_controlnet_union import cmd_controlnet_union
from tools.fixtures_ddim_eta import cmd_ddim_eta
from tools.fixtures_fullsize import cmd_fullsize
from tools.fixtures_img2img import cmd_img2img
from tools.fixtures_ip_adapter import cmd_ip_adapter
from tools.fixtures_ip_adapter_faceid import cmd_ip_adapter_faceid
from tools.fixtures_lora import cmd_lcm_lora, cmd_lora
from tools.fixtures_restart import cmd_restart
from tools.fixtures_samplers import cmd_samplers, cmd_samplers_add
from tools.fixtures_single import cmd_sgm_keys, cmd_single, cmd_single_fullsize, cmd_single_lora
from tools.fixtures_tcd import cmd_tcd
from tools.fixtures_tiny import cmd_keys, cmd_tiny
from tools.fixtures_two_calls import cmd_two_call_samplers


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.make_fixtures",
                                     description="PyTorch reference fixtures (needs torch; never run in CI).")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("tiny", help="tiny-pt, tiny-pt-conv and tiny-pt-reference under --out")
    tiny.add_argument("--out", type=Path, default=FIXTURES)
    keys = sub.add_parser("keys", help="parameter names and shapes of full-size SDXL base")
    keys.add_argument("--out", type=Path, default=FIXTURES / "sdxl-base-keys.json")
    samplers = sub.add_parser("samplers", help="scheduler step references: sampler-steps.json and .npz")
    samplers.add_argument("--out", type=Path, default=FIXTURES)
    samplers.add_argument("--add", nargs="+", metavar="CASE", help="only these cases, merged into --out's files")
    two_calls = sub.add_parser("two-call-samplers",
                               help="Heun, DPM2, DPM++ SDE, DPM2 a references: two-call-steps.json, .npz")
    two_calls.add_argument("--out", type=Path, default=FIXTURES)
    tcd = sub.add_parser("tcd", help="TCD (TCDScheduler) references: tcd-steps.json and .npz")
    tcd.add_argument("--out", type=Path, default=FIXTURES)
    ddim_eta = sub.add_parser("ddim-eta", help="DDIM with step(eta=...) references: ddim-eta-steps.json and .npz")
    ddim_eta.add_argument("--out", type=Path, default=FIXTURES)
    restart = sub.add_parser("restart", help="A1111's Restart sampler references: restart-steps.json and .npz")
    restart.add_argument("--out", type=Path, default=FIXTURES)
    single = sub.add_parser("single", help="tiny-single: tiny-pt as an sgm single file, a swap UNet and LDM VAE")
    single.add_argument("--out", type=Path, default=FIXTURES)
    sgm_keys = sub.add_parser("sgm-keys", help="full-size SDXL base's single-file key names and shapes")
    sgm_keys.add_argument("--out", type=Path, default=FIXTURES / "sdxl-base-sgm-keys.json")
    single_full = sub.add_parser("single-fullsize", help="a random full-size SDXL single file (not committed)")
    single_full.add_argument("--out", type=Path, required=True)
    single_full.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    lora = sub.add_parser("lora", help="tiny-pt-lora: a kohya and a PEFT LoRA for tiny-pt, diffusers' images with them")
    lora.add_argument("--out", type=Path, default=FIXTURES)
    single_lora = sub.add_parser("single-lora", help="tiny-single/lora-reference: both LoRAs on the single file")
    single_lora.add_argument("--out", type=Path, default=FIXTURES)
    lcm_lora = sub.add_parser("lcm-lora", help="tiny-shapes-lcm: diffusers' images with the shipped LCM-LoRA")
    lcm_lora.add_argument("--out", type=Path, default=FIXTURES)
    img2img = sub.add_parser("img2img", help="tiny-pt-img2img: diffusers' img2img images (tools.img2img_noise first)")
    img2img.add_argument("--out", type=Path, default=FIXTURES)
    ip_adapter = sub.add_parser("ip-adapter", help="tiny-pt-ip-adapter: a tiny IP-Adapter in h94's layout, diffusers' "
                                "images with it (needs tiny-pt-img2img/noise.npz)")
    ip_adapter.add_argument("--out", type=Path, default=FIXTURES)
    faceid = sub.add_parser("ip-adapter-faceid", help="tiny-pt-ip-adapter-faceid: a tiny IP-Adapter FaceID in h94's "
                            "layout, diffusers' images with face embeddings (needs tiny-pt-img2img/noise.npz)")
    faceid.add_argument("--out", type=Path, default=FIXTURES)
    sub.add_parser("controlnet-union", help="tiny-pt-controlnet-union: a tiny ControlNetUnionModel for tiny-pt, "
                   "diffusers' union pipeline's images with it (needs tiny-pt-controlnet and tiny-pt-img2img)")
    full = sub.add_parser("fullsize", help="random full-size SDXL base and its reference outputs")
    full.add_argument("--out", type=Path, required=True)
    full.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    COMMANDS[args.command](args)


# command -> what it runs with the parsed arguments
COMMANDS = {
    "tiny": lambda args: cmd_tiny(args.out),
    "keys": lambda args: cmd_keys(args.out),
    "samplers": lambda args: cmd_samplers_add(args.out, args.add) if args.add else cmd_samplers(args.out),
    "two-call-samplers": lambda args: cmd_two_call_samplers(args.out),
    "tcd": lambda args: cmd_tcd(args.out),
    "ddim-eta": lambda args: cmd_ddim_eta(args.out),
    "restart": lambda args: cmd_restart(args.out),
    "single": lambda args: cmd_single(args.out),
    "sgm-keys": lambda args: cmd_sgm_keys(args.out),
    "single-fullsize": lambda args: cmd_single_fullsize(args.out, args.dtype),
    "lora": lambda args: cmd_lora(args.out),
    "single-lora": lambda args: cmd_single_lora(args.out),
    "lcm-lora": lambda args: cmd_lcm_lora(args.out),
    "img2img": lambda args: cmd_img2img(args.out),
    "ip-adapter": lambda args: cmd_ip_adapter(args.out),
    "ip-adapter-faceid": lambda args: cmd_ip_adapter_faceid(args.out),
    "controlnet-union": lambda args: cmd_controlnet_union(),
    "fullsize": lambda args: cmd_fullsize(args.out, args.dtype),
}


if __name__ == "__main__":
    main()
