"""Evaluate a shapes model through the engine, scored by the independent checker.

    python -m tools.evaluate                        # the shipped tiny-shapes
    python -m tools.evaluate --model /tmp/ts --grid /tmp/ts.png --json /tmp/ts.json
    python -m tools.evaluate --sweep                # quality per second (below)
    python -m tools.evaluate --lcm                  # the LCM-LoRA's few-step settings against Euler-20

For each held-out (colour, shape, position) combination of :data:`shapes.HELD_OUT` (never
drawn in training) it asks the engine for 4 images of the full-description prompt (seeds
``seed``..``seed + 3``, backgrounds and sizes cycled) and reads each image with
:func:`shapes.analyse`. The single-setting evaluation runs ``--sampler`` (default Euler, the
blog's) for ``--steps`` (default 20), whatever the model's own defaults are. Reported:

* colour, shape and position accuracy over the 64 images (at ``--guidance``, the engine's
  default 5);
* guidance: the same four figures for the same prompts at guidance 1 (no guidance), at
  ``--guidance`` and at 7, among them the mean share of foreground pixels in the asked colour
  (finer than accuracy, which can be 100 % at every guidance);
* negative prompt: for each colour C, the share of C-coloured foreground pixels in images of
  ``a <shape>`` (6 shapes x 4 seeds, 24 different seeds, no colour asked) without and with
  negative prompt ``C``;
* checker sanity: the checker's own accuracy on freshly rendered held-out images (should be 1).

``--sweep`` (:func:`sweep`) instead measures quality per second, in two stages, all at
``--guidance``:

1. selection: every sampler x step count of ``--samplers`` and ``--steps-list``, plus Euler at 20
   steps (:data:`REFERENCE`), on the held-out prompts over ``--seed-groups`` groups of 4 seeds
   (``seed``, ``seed + 4``, ...): held-out accuracy per setting, and the engine's latency per
   4-image request measured interleaved in the same run (every prompt and seed group runs every
   setting, in an order rotated each round) as the median over rounds of its ratio to the
   reference's latency in the same round;
2. confirmation: the reference and the candidates (settings within :data:`TOLERANCE` of the
   reference's colour, shape and position accuracy at no more than :data:`MAX_LATENCY_RATIO` of
   its latency) again, on as many fresh seed groups, so that a setting picked for doing well on
   the first seeds must do so again on others.

The choice is the fastest setting that qualifies in both stages. The tables go to docs/benchmarks.md
(section ``quality``), everything to ``--json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
from PIL import Image

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.local import Engine
from sdxl_engine.engine.validation import GenerateRequest
from sdxl_engine.program.schedulers import SAMPLERS
from tools import shapes
from tools.report import write_section

ROOT = Path(__file__).resolve().parents[1]
BACKGROUND_CYCLE = ("white", "black", "gray", "blue")
REFERENCE = ("Euler", 20)  # the blog's setting, and the single-setting evaluation's
SWEEP_STEPS = (5, 6, 7, 8, 10, 12, 20)
TOLERANCE = 0.02  # accuracy (a fraction) a faster setting may lose on each of colour, shape, position
MAX_LATENCY_RATIO = 0.5  # ... at no more than this share of the reference's latency


def eval_prompts() -> list[tuple[str, tuple[str, str, str]]]:
    """(prompt, (colour, shape, position)) for every held-out combination; fixed sizes/backgrounds."""
    out = []
    for i, (colour, shape, position) in enumerate(shapes.HELD_OUT):
        background = BACKGROUND_CYCLE[i % 4]
        if background == colour:
            background = "gray"
        size = ("large", "small")[(i // 4) % 2]
        out.append((shapes.prompt_for(colour, shape, position, size, background), (colour, shape, position)))
    return out


def score(images: np.ndarray, target: tuple[str, str, str]) -> dict[str, float]:
    """Fraction of (n, 64, 64, 3) uint8 ``images`` whose colour / shape / position match ``target``,
    and ``colour_share``: the mean fraction of foreground pixels in the target colour."""
    reads = [shapes.analyse(im) for im in images]
    scores = {k: float(np.mean([r[k] == t for r in reads])) for k, t in zip(("colour", "shape", "position"), target)}
    return {**scores, "colour_share": float(np.mean([r["colour_shares"][target[0]] for r in reads]))}


def checker_sanity(seed: int = 0) -> dict[str, float]:
    """The checker's accuracy on rendered (ground-truth) held-out images, 4 jitters each."""
    rng = np.random.default_rng(seed)
    totals = []
    for prompt, (colour, shape, position) in eval_prompts():
        words = prompt.split()
        images = np.stack([shapes.render(shapes.Attributes(shape, colour, words[-2], position, words[1],
                                                           int(rng.integers(-3, 4)), int(rng.integers(-3, 4))))
                           for _ in range(4)])
        totals.append(score(images, (colour, shape, position)))
    return {k: float(np.mean([t[k] for t in totals])) for k in totals[0]}


def run(engine, seed: int = 0, guidance: float = EngineConfig.guidance_scale, steps: int = REFERENCE[1],
        grid: str | None = None, sampler: str = REFERENCE[0]) -> dict:
    """Every figure of the module docstring, as a dict; optionally saves a grid PNG of the images."""
    def generate(prompt, negative="", g=guidance, offset=0):
        return engine.generate(GenerateRequest(prompt, negative_prompt=negative, seed=seed + offset, guidance_scale=g,
                                               num_inference_steps=steps, sampler=sampler)).images

    start = time.perf_counter()
    per_prompt, rows, by_guidance = [], [], {}
    for g in dict.fromkeys((guidance, 1.0, 7.0)):  # the one evaluated, none, and 7 (A1111's default)
        scores = []
        for prompt, target in eval_prompts():
            images = generate(prompt, g=g)
            scores.append(score(images, target))
            if g == guidance:
                per_prompt.append({"prompt": prompt, **scores[-1]})
                rows.append(np.concatenate(list(images), axis=1))
        by_guidance[f"at_{g:g}"] = {k: float(np.mean([s[k] for s in scores])) for k in scores[0]}
    negative = {}
    for colour in shapes.COLOURS:
        shares = []
        for neg in ("", colour):
            images = np.concatenate([generate(f"a {shape}", neg, offset=4 * i)
                                     for i, shape in enumerate(shapes.SHAPES)])
            shares.append(float(np.mean([shapes.analyse(im)["colour_shares"][colour] for im in images])))
        negative[colour] = {"without": round(shares[0], 4), "with": round(shares[1], 4)}
    if grid:
        Image.fromarray(np.concatenate(rows, axis=0)).resize((4 * 64 * 3, len(rows) * 64 * 3), 0).save(grid)
    return {
        "model": engine.model.name, "seed": seed, "sampler": sampler, "steps": steps, "guidance_scale": guidance,
        "held_out_accuracy": by_guidance[f"at_{guidance:g}"],
        "guidance": by_guidance,
        "negative_prompt_colour_share": negative,
        "negative_prompt_lowers_share": sum(v["with"] < v["without"] for v in negative.values()),
        "negative_prompt_colours_present": sum(v["without"] > 0 for v in negative.values()),
        "checker_on_rendered_images": checker_sanity(seed),
        "per_prompt": per_prompt,
        "eval_s": round(time.perf_counter() - start, 1),
    }


ACCURACY = ("colour", "shape", "position")


def measure(engine, settings: list[tuple], seeds: list[int], guidance: float, log=print) -> list[dict]:
    """Held-out accuracy and latency of each setting in ``settings``, side by side in one run.

    A setting is (sampler, steps) at ``guidance``, or (sampler, steps, guidance_scale, prompt prefix)
    (the LCM evaluation: ``"<lora:lcm:1> "`` before the prompt). Every (held-out prompt, seed) is one
    round; each round runs every setting once, starting one setting later than the round before, so
    a noisy neighbour slows every setting alike. Accuracy is over the same 16 prompts x 4 x
    ``len(seeds)`` images for every setting; latency is the engine's (``timings["latency"]``: prep +
    device + post, queue excluded) per 4-image request.

    Returns one row per setting: colour, shape, position (fractions), colour_share, the same three
    per seed group, the median latency, the median over rounds of its latency over the first
    setting's (the reference) in the same round, each round's latency, and
    whether the row is within :data:`TOLERANCE` of the first on each accuracy and at most
    :data:`MAX_LATENCY_RATIO` of its latency.
    """
    full = [tuple(s) if len(s) == 4 else (s[0], s[1], guidance, "") for s in settings]
    scores = {s: [] for s in full}
    latency = {s: [] for s in full}
    device = {s: [] for s in full}
    start = time.perf_counter()
    rounds = [(prompt, target, s) for s in seeds for prompt, target in eval_prompts()]
    for r, (prompt, target, request_seed) in enumerate(rounds):
        for k in range(len(full)):
            setting = full[(k + r) % len(full)]
            sampler, n, g, prefix = setting
            result = engine.generate(GenerateRequest(prefix + prompt, seed=request_seed, guidance_scale=g,
                                                     num_inference_steps=n, sampler=sampler))
            scores[setting].append({**score(result.images, target), "seed": request_seed})
            latency[setting].append(result.timings["latency"])
            device[setting].append(result.timings["device"])
        log(f"  round {r + 1}/{len(rounds)} ({time.perf_counter() - start:.0f} s)")
    rows = []
    for setting in full:
        got = scores[setting]
        rows.append({"sampler": setting[0], "steps": setting[1], "guidance_scale": setting[2],
                     "prompt_prefix": setting[3],
                     **{k: float(np.mean([x[k] for x in got])) for k in (*ACCURACY, "colour_share")},
                     "by_seed_group": {str(s): {k: float(np.mean([x[k] for x in got if x["seed"] == s]))
                                                for k in ACCURACY} for s in seeds},
                     "latency_s": statistics.median(latency[setting]),
                     # Paired: this setting's latency over the reference's in the same round (seconds apart),
                     # so the machine's load, which drifts over minutes, cancels; the median over the rounds.
                     "latency_ratio": statistics.median(a / b for a, b in zip(latency[setting], latency[full[0]])),
                     "latency_per_round_s": [round(x, 4) for x in latency[setting]],
                     "device_s": statistics.median(device[setting]),
                     "device_ratio": statistics.median(a / b for a, b in zip(device[setting], device[full[0]]))})
    reference = rows[0]
    for row in rows:
        row["loss"] = max(reference[k] - row[k] for k in ACCURACY)  # the worst of the three, as a fraction
        row["within_tolerance"] = row["loss"] <= TOLERANCE + 1e-9
        row["fast_enough"] = row["latency_ratio"] <= MAX_LATENCY_RATIO
    return rows


# The few-step evaluation: Euler-20 at the default guidance (the reference) against the LCM-LoRA's
# settings (no CFG) and two controls: LCM without the LoRA, and Euler at 4 steps with CFG.
LCM_TAG = "<lora:lcm:1> "
LCM_MAX_LATENCY_RATIO = 0.15  # device time: 4 no-CFG UNet passes against Euler-20's 40


def lcm_settings(guidance: float) -> list[tuple]:
    """(sampler, steps, guidance_scale, prompt prefix) of :func:`lcm_evaluation`, the reference first."""
    return [("Euler", 20, guidance, ""), ("LCM", 4, 1.0, LCM_TAG), ("LCM", 2, 1.0, LCM_TAG), ("LCM", 1, 1.0, LCM_TAG),
            ("LCM", 8, 1.0, LCM_TAG), ("LCM", 4, 1.0, ""), ("Euler", 4, guidance, "")]


def lcm_evaluation(engine, seed: int = 1000, seed_groups: int = 4, guidance: float = EngineConfig.guidance_scale,
                   log=print) -> dict:
    """:func:`measure` of :func:`lcm_settings` on ``seed_groups`` x 64 held-out images per setting."""
    start = time.perf_counter()
    seeds = [seed + 4 * g for g in range(seed_groups)]
    rows = measure(engine, lcm_settings(guidance), seeds, guidance, log)
    for row in rows:  # the measure: device time (the program: text encoders, UNet steps, VAE decode)
        row["fast_enough"] = row["device_ratio"] <= LCM_MAX_LATENCY_RATIO
    return {"model": engine.model.name, "machine": f"{platform.machine()} {os.cpu_count()} cores, "
            f"{engine.device_summary}", "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "reference": {"sampler": "Euler", "steps": 20, "guidance_scale": guidance}, "tolerance": TOLERANCE,
            "max_latency_ratio": LCM_MAX_LATENCY_RATIO, "images_per_setting": 64 * seed_groups, "seeds": seeds,
            "settings": rows, "eval_s": round(time.perf_counter() - start, 1)}


def lcm_markdown(result: dict) -> str:
    """The docs/benchmarks.md section ``quality-lcm``: one row per setting, the reference first."""
    n = result["images_per_setting"]
    lines = [f"Run: {result['run']} · {result['machine']} · model `{result['model']}` · 16 held-out prompts x "
             f"{n // 16} images = {n} images per setting (seeds {result['seeds'][0]}–{result['seeds'][-1] + 3}, "
             f"not used in training), 1 image = {100 / n:.2f} points · device time (the compiled program) and latency "
             "(prep + device + post): the engine's medians per 4-image request; ratios: the median over rounds of "
             "the time over Euler-20's in the same round, all settings interleaved in one run",
             "", "| setting | LoRA | guidance | colour | shape | position | worst loss (points) | device (s) | "
             "device ratio | latency (s) | latency ratio | within 2 points | device ≤ 0.15x |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(result["settings"]):
        name = f"{row['sampler']} {row['steps']}" + (" (reference)" if i == 0 else "")
        lines.append(f"| {name} | {'lcm' if row['prompt_prefix'] else '—'} | {row['guidance_scale']:g} | "
                     f"{100 * row['colour']:.1f} % | {100 * row['shape']:.1f} % | {100 * row['position']:.1f} % | "
                     f"{100 * max(row['loss'], 0):.2f} | {row['device_s']:.3f} | {row['device_ratio']:.3f} | "
                     f"{row['latency_s']:.3f} | {row['latency_ratio']:.2f} | "
                     f"{'yes' if row['within_tolerance'] else 'no'} | {'yes' if row['fast_enough'] else 'no'} |")
    return "\n".join(lines)


def sweep(engine, samplers=SAMPLERS, steps=SWEEP_STEPS, seed: int = 0, seed_groups: int = 4,
          guidance: float = EngineConfig.guidance_scale, log=print) -> dict:
    """Both stages of the module docstring's ``--sweep``; returns the rows of each and the choice."""
    start = time.perf_counter()
    settings = list(dict.fromkeys([REFERENCE, *itertools.product(samplers, steps)]))
    seeds = [seed + 4 * g for g in range(seed_groups)]
    fresh = [seed + 4 * (seed_groups + g) for g in range(seed_groups)]
    rows = measure(engine, settings, seeds, guidance, log)
    candidates = [(r["sampler"], r["steps"]) for r in rows[1:] if r["within_tolerance"] and r["fast_enough"]]
    confirmation = measure(engine, [REFERENCE, *candidates], fresh, guidance, log) if candidates else []
    return {
        "model": engine.model.name, "machine": f"{platform.machine()} {os.cpu_count()} cores, {engine.device_summary}",
        "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "guidance_scale": guidance,
        "reference": dict(zip(("sampler", "steps"), REFERENCE)), "tolerance": TOLERANCE,
        "max_latency_ratio": MAX_LATENCY_RATIO, "images_per_setting": 64 * seed_groups,
        "seeds": seeds, "settings": rows, "confirmation_seeds": fresh, "confirmation": confirmation,
        "choice": choose(rows, confirmation), "eval_s": round(time.perf_counter() - start, 1),
    }


def choose(rows: list[dict], confirmation: list[dict]) -> dict | None:
    """The fastest setting within tolerance and fast enough in both stages, or None.

    Fastest = fewest steps: every sampler runs the same program, so the step count decides the
    cost and medians of samplers at one step count differ by noise only. Among those, the one
    whose worst accuracy loss over both stages is smallest.
    """
    def ok(row):
        return row["within_tolerance"] and row["fast_enough"]

    first = {(r["sampler"], r["steps"]): r for r in rows[1:] if ok(r)}
    both = [(r, first[r["sampler"], r["steps"]]) for r in confirmation[1:]
            if ok(r) and (r["sampler"], r["steps"]) in first]
    if not both:
        return None
    best, _ = min(both, key=lambda pair: (pair[0]["steps"], max(pair[0]["loss"], pair[1]["loss"])))
    return {"sampler": best["sampler"], "steps": best["steps"]}


def _table(rows: list[dict], reference: dict, choice: dict) -> list[str]:
    lines = ["| sampler | steps | colour | shape | position | worst loss (points) | latency (s) | ratio | "
             "within 2 points | ≤ 0.5x |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        setting = (row["sampler"], row["steps"])
        name = f"**{row['sampler']}**" if setting == (choice.get("sampler"), choice.get("steps")) else row["sampler"]
        if setting == (reference["sampler"], reference["steps"]):
            name += " (reference)"
        lines.append(f"| {name} | {row['steps']} | {100 * row['colour']:.1f} % | {100 * row['shape']:.1f} % | "
                     f"{100 * row['position']:.1f} % | {100 * max(row['loss'], 0):.2f} | {row['latency_s']:.3f} | "
                     f"{row['latency_ratio']:.2f} | {'yes' if row['within_tolerance'] else 'no'} | "
                     f"{'yes' if row['fast_enough'] else 'no'} |")
    return lines


def grid(rows: list[dict]) -> list[str]:
    """Colour / shape / position accuracy (%) with one row per sampler, one column per step count, and the
    latency ratio per step count (the median of the samplers': they run one program, so steps set the cost)."""
    steps = sorted({r["steps"] for r in rows})
    samplers = list(dict.fromkeys(r["sampler"] for r in rows))
    cell = {(r["sampler"], r["steps"]): r for r in rows}
    lines = ["| colour / shape / position (%) | " + " | ".join(f"{n} steps" for n in steps) + " |",
             "|---|" + "---|" * len(steps)]
    for sampler in samplers:
        lines.append(f"| {sampler} | " + " | ".join(
            "/".join(f"{100 * cell[sampler, n][k]:.1f}" for k in ACCURACY) if (sampler, n) in cell else ""
            for n in steps) + " |")
    ratios = [statistics.median(r["latency_ratio"] for r in rows if r["steps"] == n) for n in steps]
    lines.append("| latency ÷ Euler-20's | " + " | ".join(f"{x:.2f}x" for x in ratios) + " |")
    return lines


def sweep_markdown(result: dict) -> str:
    """The docs/benchmarks.md section: the selection table (reference first), the confirmation table, the choice."""
    ref, n, choice = result["reference"], result["images_per_setting"], result["choice"] or {}
    name = f"{ref['sampler']}-{ref['steps']}"
    seeds = lambda s: f"seeds {s[0]}–{s[-1] + 3}"  # noqa: E731
    lines = [f"Run: {result['run']} · {result['machine']} · model `{result['model']}` · guidance "
             f"{result['guidance_scale']:g} · 16 held-out prompts x {n // 16} images: {n} images per setting, "
             f"1 image = {100 / n:.2f} points · latency: the engine's median per 4-image request, the settings of "
             f"each table interleaved in one run; ratio: the median over rounds of the latency over {name}'s in "
             f"the same round (seconds apart)",
             "", f"Selection ({seeds(result['seeds'])}), at a glance:", "", *grid(result["settings"]),
             "", "In full:", "", *_table(result["settings"], ref, choice)]
    if result["confirmation"]:
        lines += ["", f"Confirmation of the candidates on fresh seeds ({seeds(result['confirmation_seeds'])}):", "",
                  *_table(result["confirmation"], ref, choice)]
    lines.append("")
    limits = f"within {100 * result['tolerance']:g} points of {name} on colour, shape and position at ≤ " \
             f"{result['max_latency_ratio']:g}x its latency"
    if choice:
        lines.append(f"Fastest setting {limits} in both tables: **{choice['sampler']}, {choice['steps']} steps**.")
    else:
        lines.append(f"No setting is {limits} in both tables.")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-shapes", help="built-in name or diffusers directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--guidance", type=float, default=EngineConfig.guidance_scale, help="default: the engine's")
    p.add_argument("--steps", type=int, default=REFERENCE[1])
    p.add_argument("--sampler", default=REFERENCE[0], help="the single-setting evaluation's sampler")
    p.add_argument("--grid", help="save the held-out images as one PNG here")
    p.add_argument("--json", help="write the report here too (sweep: default bench_quality.json)")
    p.add_argument("--sweep", action="store_true", help="every sampler x step count instead (module docstring)")
    p.add_argument("--samplers", default=",".join(SAMPLERS), help="sweep: comma-separated sampler names")
    p.add_argument("--steps-list", default=",".join(map(str, SWEEP_STEPS)), help="sweep: comma-separated step counts")
    p.add_argument("--seed-groups", type=int, default=4, help="sweep: groups of 4 seeds per prompt, per stage")
    p.add_argument("--md", default=str(ROOT / "docs/benchmarks.md"),
                   help="sweep: rewrite its 'quality' section ('' = no)")
    p.add_argument("--lcm", action="store_true", help="the LCM-LoRA evaluation instead (lcm_evaluation; seeds from "
                   "--seed, default 1000; writes docs/benchmarks.md's 'quality-lcm' section)")
    p.add_argument("--lora", default="", help="--lora NAME=PATH for the engine (e.g. lcm=/tmp/lcm.safetensors: "
                   "another LoRA under the name the LCM evaluation uses)")
    args = p.parse_args(argv)

    settings = {"model": args.model, **({"lora": args.lora} if args.lora else {})}
    engine = Engine(EngineConfig.load(settings), log=lambda *_: None).start()
    if args.lcm:
        report = lcm_evaluation(engine, args.seed if args.seed else 1000, args.seed_groups, args.guidance,
                                log=lambda line: print(line, flush=True))
        print(lcm_markdown(report))
        if args.md:
            write_section(Path(args.md), "quality-lcm", lcm_markdown(report))
        args.json = args.json or str(ROOT / "docs" / "benchmarks" / "bench_quality_lcm.json")
    elif args.sweep:
        report = sweep(engine, [s.strip() for s in args.samplers.split(",")],
                       [int(n) for n in args.steps_list.split(",")], args.seed, args.seed_groups, args.guidance,
                       log=lambda line: print(line, flush=True))
        print(sweep_markdown(report))
        if args.md:
            write_section(Path(args.md), "quality", sweep_markdown(report))
        args.json = args.json or str(ROOT / "docs" / "benchmarks" / "bench_quality.json")
    else:
        report = run(engine, args.seed, args.guidance, args.steps, args.grid, args.sampler)
        for row in report["per_prompt"]:
            print(f"  {row['prompt']:<62} colour {row['colour']:.2f} shape {row['shape']:.2f} "
                  f"position {row['position']:.2f}")
        print(json.dumps({k: v for k, v in report.items() if k != "per_prompt"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
