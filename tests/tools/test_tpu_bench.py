"""tools/tpu_bench.py's arithmetic: the engine's per-image seconds over the blog pipeline's, per count both ran."""

from tools.tpu_bench import ratios


def test_ratios_pair_each_engine_run_with_the_blog_run_of_its_count_else_one_image():
    report = {"runs": [{"start": "cold", "images": 1, "per_image_s": 2.0},
                       {"start": "warm", "images": 4, "per_image_s": 1.5},
                       {"start": "cold", "images": 2, "error": "no result"}],
              "blog": {"results": [{"images_per_call": 1, "per_image_s": 2.5},
                                   {"images_per_call": 4, "oom": True, "error": "RESOURCE_EXHAUSTED"}]}}
    assert ratios(report) == {"1 images, cold": 0.8, "4 images, warm": 0.6}
    assert ratios({"runs": report["runs"]}) == {}  # no blog run: no ratio
