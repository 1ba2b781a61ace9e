"""The executable cache loads only what this installation wrote, and says why when it does not.

Each refusal test plants a file that passes every check but the one under test and whose
bytes are a pickle that would create a marker folder if anything unpickled it: the marker never
appears, the lookup returns no executable and one note says why (the engine then compiles and
logs that note in its one compile line; test_executables_restart.py checks that end to end).
"""

import hashlib
import json
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdxl_engine.program import executables
from sdxl_engine.program.executables import ExecutableCache, key_digest, runtime_key
from sdxl_engine.program.sharding import make_mesh

KEY = {"program": "test: x @ w, 4 rows"}


class Payload:
    """Unpickling this creates ``marker``: the proof that a file was (or was not) deserialized."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.fixture(scope="module")
def program():
    """A small sharded program compiled ahead of time, its pytrees and devices."""
    mesh = make_mesh()
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = {"w": jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8), rep)}
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=data)
    fn = jax.jit(lambda p, x: ((x @ p["w"]).sum(-1), jnp.isfinite(x).all(-1)), in_shardings=(rep, data),
                 out_shardings=(data, data))
    compiled = fn.lower(params, x).compile()
    return dict(compiled=compiled, params=params, devices=list(mesh.devices.flat),
                in_tree=jax.tree.structure(((params, x), {})), out_tree=jax.tree.structure((0, 0)))


def store(cache, program):
    return cache.store(KEY, program["compiled"], program["devices"], program["in_tree"], program["out_tree"])


def load(cache, program):
    return cache.load(KEY, program["in_tree"], program["out_tree"], program["devices"])


def plant(cache, program, marker, mac_secret: bytes | None = None):
    """Replace the stored executable by a Payload pickle; the manifest entry is rewritten to match it
    (size, SHA-256, and an HMAC under ``mac_secret``, default this cache's own: a perfect forgery)."""
    digest = key_digest({**KEY, **runtime_key(program["devices"])})
    path = cache.directory / f"{digest}.xla"
    blob = pickle.dumps(Payload(marker))
    path.write_bytes(blob)
    manifest = json.loads(cache.manifest_path.read_bytes())
    entry = manifest["entries"][digest]
    entry.update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    entry["mac"] = executables._mac(mac_secret or cache.secret_path.read_bytes(), digest, entry)
    cache.manifest_path.write_text(json.dumps(manifest))
    return path


def test_stored_executable_loads_and_runs_with_private_files(tmp_path, program):
    cache = ExecutableCache(tmp_path / "executables")
    assert load(cache, program).note == "miss: nothing stored yet"
    note = store(cache, program)
    assert note.startswith("stored ") and note.endswith("MB)"), note
    assert os.stat(cache.directory).st_mode & 0o777 == 0o700
    for path in cache.directory.iterdir():
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert_loads_and_runs(load(cache, program), program)


def assert_loads_and_runs(found, program) -> None:
    """``found`` was loaded from the cache and computes the program's result: each of 4 rows of ones
    times the (8, 8) arange weights, summed, is the weights' total; all finite."""
    assert found.note.startswith("loaded "), found.note
    out, finite = found.executable(program["params"], np.ones((4, 8), np.float32))
    assert np.asarray(out).tolist() == [np.arange(64).reshape(8, 8).sum()] * 4 and np.asarray(finite).all()


def test_the_planted_payload_is_live_once_every_check_passes(tmp_path, program):
    """Control for the tests below: the same forged file, with nothing wrong, does get unpickled."""
    cache = ExecutableCache(tmp_path / "executables")
    store(cache, program)
    plant(cache, program, tmp_path / "marker")
    found = load(cache, program)
    assert (tmp_path / "marker").exists() and found.executable is None and "did not deserialize" in found.note


def test_tampered_file_is_refused(tmp_path, program):
    cache = ExecutableCache(tmp_path / "executables")
    store(cache, program)
    path = plant(cache, program, tmp_path / "marker")
    path.write_bytes(path.read_bytes() + b" ")  # changed after the manifest recorded it
    found = load(cache, program)
    assert found.executable is None and not (tmp_path / "marker").exists()
    assert found.note == f"refused {path.name}: its size or SHA-256 differs from the manifest's (changed on disk)"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o400])
def test_file_with_another_mode_is_refused(tmp_path, program, mode):
    cache = ExecutableCache(tmp_path / "executables")
    store(cache, program)
    path = plant(cache, program, tmp_path / "marker")
    path.chmod(mode)
    found = load(cache, program)
    assert found.executable is None and not (tmp_path / "marker").exists()
    assert found.note == f"refused {path.name}: {path.name} has mode {mode:04o}, not 0600"


def test_foreign_manifest_entry_is_refused(tmp_path, program):
    """An entry whose HMAC is not under this cache's secret (another installation's, or hand-made)."""
    cache = ExecutableCache(tmp_path / "executables")
    store(cache, program)
    path = plant(cache, program, tmp_path / "marker", mac_secret=b"another installation's secret!!!")
    found = load(cache, program)
    assert found.executable is None and not (tmp_path / "marker").exists()
    assert found.note == (f"refused {path.name}: its manifest entry was not written by this installation "
                          "(the HMAC does not match this cache's secret)")


def test_a_start_records_what_it_loaded_and_the_next_start_of_its_name_reads_it_early(tmp_path, program):
    first = ExecutableCache(tmp_path / "executables")
    store(first, program)
    assert first.finish_start("start-a") == (0, 0)
    assert (first.starts_path.stat().st_mode & 0o777) == 0o600
    digest = key_digest({**KEY, **runtime_key(program["devices"])})
    assert json.loads(first.starts_path.read_text())["starts"]["start-a"]["digests"] == [digest]

    second = ExecutableCache(tmp_path / "executables")
    assert second.preload("start-b", program["devices"]) == 0  # another configuration: nothing read early
    assert second.preload("start-a", program["devices"]) == 1
    found = load(second, program)
    assert found.note.endswith(" (preloaded)"), found.note
    assert_loads_and_runs(found, program)
    assert second.finish_start("start-a") == (1, 0)

    third = ExecutableCache(tmp_path / "executables")  # read early, not asked for: dropped at the start's end
    assert third.preload("start-a", program["devices"]) == 1
    assert third.finish_start("start-a") == (0, 1)
    assert json.loads(third.starts_path.read_text())["starts"]["start-a"]["digests"] == [digest]  # kept


def test_a_recorded_entry_that_fails_a_check_is_not_read_early(tmp_path, program):
    """The record names what to read; every check of load() still applies to it (here: a forged pickle under
    another installation's HMAC, and a file changed after a clean preload)."""
    cache = ExecutableCache(tmp_path / "executables")
    store(cache, program)
    cache.finish_start("start")
    path = plant(cache, program, tmp_path / "marker", mac_secret=b"another installation's secret!!!")
    again = ExecutableCache(tmp_path / "executables")
    assert again.preload("start", program["devices"]) == 1
    found = load(again, program)
    assert found.executable is None and not (tmp_path / "marker").exists()
    assert found.note.startswith(f"refused {path.name}: its manifest entry was not written by this installation")

    clean = ExecutableCache(tmp_path / "fresh")
    store(clean, program)
    clean.finish_start("start")
    early = ExecutableCache(tmp_path / "fresh")
    assert early.preload("start", program["devices"]) == 1
    assert early._preloaded[path.stem].result() is not None  # read and deserialized while the entry was clean
    blob = (clean.directory / path.name).read_bytes()
    manifest = json.loads(clean.manifest_path.read_bytes())  # the entry rewritten (a new store) after the preload
    manifest["entries"][path.stem]["sha256"] = hashlib.sha256(blob + b"x").hexdigest()
    manifest["entries"][path.stem]["mac"] = executables._mac(clean.secret_path.read_bytes(), path.stem,
                                                             manifest["entries"][path.stem])
    clean.manifest_path.write_text(json.dumps(manifest))
    found = load(early, program)
    assert found.executable is None and "(preloaded)" not in found.note
    assert found.note == f"refused {path.name}: its size or SHA-256 differs from the manifest's (changed on disk)"


def test_version_change_is_a_miss_that_names_it(tmp_path, program, monkeypatch):
    cache = ExecutableCache(tmp_path / "executables")
    store(cache, program)
    plant(cache, program, tmp_path / "marker")  # under the running version's key
    written_by = jax.__version__
    monkeypatch.setattr(executables.jax, "__version__", "99.0")
    found = load(cache, program)
    assert found.executable is None and not (tmp_path / "marker").exists()
    assert found.note == f"miss: stored for jax {written_by}, this is 99.0"


def test_open_folder_symlink_and_foreign_owner_are_refused(tmp_path, program):
    cache = ExecutableCache(tmp_path / "executables")
    store(cache, program)
    path = plant(cache, program, tmp_path / "marker")
    cache.directory.chmod(0o777)
    assert "is writable by others (mode 0777)" in load(cache, program).note
    cache.directory.chmod(0o700)
    real = path.with_name("elsewhere")
    path.rename(real)
    path.symlink_to(real)
    assert load(cache, program).note == f"refused {path.name}: {path.name} is a symlink"
    path.unlink()
    real.rename(path)
    cache.manifest_path.chmod(0o644)
    assert load(cache, program).note == f"refused {path.name}: manifest.json has mode 0644, not 0600"
    cache.manifest_path.chmod(0o600)
    if os.getuid() == 0:  # only root can give a file away
        os.chown(path, 65534, 65534)
        note = load(cache, program).note
        assert note == f"refused {path.name}: {path.name} belongs to uid 65534, not to this user (0)"
    assert not (tmp_path / "marker").exists()


def test_a_manifest_that_is_not_ours_is_refused_and_replaced(tmp_path, program):
    cache = ExecutableCache(tmp_path / "executables")
    store(cache, program)
    cache.manifest_path.write_text("{not json")
    note = load(cache, program).note
    assert note.startswith("refused ") and note.endswith("manifest.json is not JSON (Expecting property name "
                                                           "enclosed in double quotes: line 1 column 2 (char 1))")
    assert "replaced the manifest (manifest.json is not JSON" in store(cache, program)
    assert_loads_and_runs(load(cache, program), program)


def test_a_refused_entry_is_replaced_by_the_next_store(tmp_path, program):
    cache = ExecutableCache(tmp_path / "executables")
    store(cache, program)
    plant(cache, program, tmp_path / "marker", mac_secret=b"x" * 32)
    assert load(cache, program).executable is None
    assert store(cache, program).startswith("stored ")
    assert_loads_and_runs(load(cache, program), program)
    assert not (tmp_path / "marker").exists()


def test_every_file_of_program_and_models_is_in_the_source_digest():
    """The executable cache's key covers the traced code by folder: a new file under program/ or
    models/ is in it without anyone listing it (a hand-kept list forgets the next file)."""
    from sdxl_engine.program import compiling

    package = compiling._PACKAGE
    expected = sorted(p.relative_to(package).as_posix() for folder in ("program", "models")
                      for p in (package / folder).rglob("*.py"))
    assert [p.relative_to(package).as_posix() for p in compiling.program_sources()] == expected
    assert {"program/generate.py", "program/schedulers.py", "models/unet.py", "models/__init__.py"} <= set(expected)


def test_the_source_digest_follows_content_and_place(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one, moved = tmp_path / "a" / "x.py", tmp_path / "b" / "x.py"
    one.write_text("x = 1\n")
    moved.write_text("x = 1\n")
    digest = executables.source_digest([one], root=tmp_path)
    assert digest == executables.source_digest([one], root=tmp_path)  # deterministic
    assert executables.source_digest([moved], root=tmp_path) != digest  # same content, another folder
    one.write_text("x = 2\n")
    assert executables.source_digest([one], root=tmp_path) != digest  # another content


def test_pruning_keeps_what_the_last_starts_loaded(tmp_path, program, monkeypatch):
    """Past MAX_ENTRIES the oldest entries go, but not those a recent start record names: the executables the next
    start reads first (a new user's server lost them after compiling other sizes, and its warm start compiled)."""
    monkeypatch.setattr(executables, "MAX_ENTRIES", 2)
    cache = ExecutableCache(tmp_path / "executables")

    def put(name):
        key = {"program": name}
        cache.store(key, program["compiled"], program["devices"], program["in_tree"], program["out_tree"])
        return key_digest({**key, **runtime_key(program["devices"])})

    first = put("the start's")
    cache.finish_start("start")  # records `first`
    others = [put(f"size {k}") for k in range(3)]
    listed = set(json.loads(cache.manifest_path.read_bytes())["entries"])
    assert listed == {first, *others[-2:]}  # the two newest, and the recorded one beyond them
    assert sorted(p.stem for p in cache.directory.glob("*.xla")) == sorted(listed)
    again = ExecutableCache(tmp_path / "executables")
    assert again.preload("start", program["devices"]) == 1
    found = again.load({"program": "the start's"}, program["in_tree"], program["out_tree"], program["devices"])
    assert found.note.endswith("(preloaded)")


def test_a_start_record_out_of_shape_is_written_anew_and_never_stops_a_start(tmp_path, program):
    cache = ExecutableCache(tmp_path / "executables")
    store(cache, program)
    cache.starts_path.write_text(json.dumps({"starts": {"other": {"digests": 5, "written": "yesterday"},
                                                        "x": {"written": None}}}))
    cache.starts_path.chmod(0o600)
    assert cache.finish_start("start") == (0, 0)  # no exception, and the record written anew beside them
    assert ExecutableCache(tmp_path / "executables").preload("other", program["devices"]) == 0
    assert ExecutableCache(tmp_path / "executables").preload("start", program["devices"]) == 1


def test_a_miss_for_a_pruned_entry_says_pruning_removed_it(tmp_path, program, monkeypatch):
    """A key stored and then pruned (MAX_ENTRIES) is a miss that names the pruning, not a change of the field where
    the newest entry of its program differs (a new user read "another source (changed since it was written)" for an
    entry pruning had removed, and looked for a source change); a key never stored still names that field."""
    monkeypatch.setattr(executables, "MAX_ENTRIES", 2)
    cache = ExecutableCache(tmp_path / "executables")

    def key(source):
        return {"program": "p", "source": source}

    for source in ("s1", "s2", "s3"):
        cache.store(key(source), program["compiled"], program["devices"], program["in_tree"], program["out_tree"])
    pruned = key_digest({**key("s1"), **runtime_key(program["devices"])})
    assert pruned not in json.loads(cache.manifest_path.read_bytes())["entries"]
    found = cache.load(key("s1"), program["in_tree"], program["out_tree"], program["devices"])
    assert found.executable is None
    assert found.note == ("miss: removed by the cache's pruning (it keeps the newest 2 entries, and those the last 4 "
                          "starts loaded)")
    found = cache.load(key("s9"), program["in_tree"], program["out_tree"], program["devices"])
    assert found.note == "miss: stored for another source (changed since it was written)"
    cache.store(key("s1"), program["compiled"], program["devices"], program["in_tree"], program["out_tree"])
    assert cache.load(key("s1"), program["in_tree"], program["out_tree"], program["devices"]).executable is not None


def test_the_key_names_the_gelu_formula_the_trace_reads(tiny_pt, monkeypatch):
    """models/unet.GEGLU_MODE is read while tracing, not from a source file: the key carries it, so a program
    traced with one GELU formula (tools.tpu_profile --geglu) is never loaded for another."""
    from sdxl_engine.models import unet
    from sdxl_engine.program.compiling import program_key
    from sdxl_engine.program.generate import ProgramShape

    shape, mesh = ProgramShape(2, 64, 64, 4), make_mesh(jax.devices()[:2])
    exact = program_key(tiny_pt, tiny_pt.params, shape, mesh)
    monkeypatch.setattr(unet, "GEGLU_MODE", "split-tanh")
    tanh = program_key(tiny_pt, tiny_pt.params, shape, mesh)
    assert (exact["geglu"], tanh["geglu"]) == ("split", "split-tanh")
    assert key_digest(exact) != key_digest(tanh) and {k for k in exact if exact[k] != tanh[k]} == {"geglu"}
