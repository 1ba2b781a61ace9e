"""tools/compile_share.py: a pytest run's JAX compile seconds, counted per test in the pytest process and in the
processes its tests start, without importing JAX into a process that does not."""

import json
import textwrap

from tools import compile_share

TESTS = '''
import subprocess
import sys

import jax
import jax.numpy as jnp

ONE = jax.ShapeDtypeStruct((3,), jnp.float32)


def test_two_compiles():
    jax.jit(lambda x: x + 1).lower(ONE).compile()
    jax.jit(lambda x: x * 2).lower(ONE).compile()


def test_a_process_it_starts_compiles_once():
    subprocess.run([sys.executable, "-c", "import jax, jax.numpy as jnp; "
                    "jax.jit(lambda x: x - 1).lower(jax.ShapeDtypeStruct((5,), jnp.float32)).compile()"], check=True)


def test_a_process_without_jax_stays_without_it():
    subprocess.run([sys.executable, "-c", "import sys; assert not [m for m in sys.modules if m.startswith('jax')]"],
                   check=True)
'''


def test_compiles_are_counted_per_test_and_per_process(tmp_path, capsys):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(TESTS))
    out = tmp_path / "share.json"
    status = compile_share.main(["--json", str(out), "--", "-q", "-p", "no:cacheprovider", "-c",
                                 str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path)])
    assert status == 0, capsys.readouterr().out
    summary = json.loads(out.read_text())
    tests = {name.rsplit("::", 1)[1]: row for name, row in summary["tests"].items()}
    # Two XLA compiles in the pytest process, under the test that made them; one in the process the second test
    # started, counted under that test; the process without JAX wrote nothing (and its assertion held: status 0).
    assert tests["test_two_compiles"]["compiles"] == 2 and tests["test_two_compiles"]["compile_s"] > 0
    assert tests["test_a_process_it_starts_compiles_once"]["compiles"] == 1
    assert "test_a_process_without_jax_stays_without_it" not in tests
    assert summary["processes"] == {"tests": 1, "apps": 1}
    assert summary["totals"]["tests"]["compiles"] == 2 and summary["totals"]["apps"]["compiles"] == 1
    assert summary["totals"]["apps"]["compile_s"] == tests["test_a_process_it_starts_compiles_once"]["compile_s"]
    assert list(summary["files"]) == ["test_sample.py"] and summary["files"]["test_sample.py"]["compiles"] == 3
    printed = capsys.readouterr().out
    assert "by file:" in printed and "test_sample.py" in printed
