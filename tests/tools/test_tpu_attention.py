"""tools/tpu_attention: the kernel variants it names and times on a chip (the kernels' values are checked against the
XLA path in interpret mode in tests/models/test_layers_attention.py)."""

import pytest

from tools.tpu_attention import kernels, whole_kernel


def test_a_whole_row_kernels_name_says_its_options():
    f = whole_kernel("whole_packed_q1024_mxu_h4")
    assert f.keywords == {"block_q": 1024, "layout": "packed", "row_sum": "mxu", "heads_per_step": 4}
    assert whole_kernel("whole_heads_first_q256").keywords == {"block_q": 256, "layout": "heads_first",
                                                              "row_sum": "vpu", "heads_per_step": 2}
    with pytest.raises(ValueError, match="not a whole-row kernel's name: 'flash_512'"):
        whole_kernel("flash_512")


def test_four_heads_a_step_are_timed_only_where_the_heads_divide_by_four():
    """SDXL at 1024²: 20 heads over 1024 tokens, 10 over 4096 (4 do not divide 10)."""
    assert {"whole_packed_q512", "whole_packed_q1024_mxu", "whole_packed_q1024_mxu_h4"} <= set(kernels(1024))
    assert "whole_packed_q1024_mxu" in kernels(4096)
    assert not [name for name in kernels(4096) if name.endswith("_h4")]
