"""The models a server offers, by name: ``--model`` (repeatable; the first is the default), ``--models-dir`` (every
diffusers folder and SDXL ``.safetensors`` file in it, as A1111's ``models/Stable-diffusion``), and the same for
refiners (``--refiner``, ``--refiners-dir``). Files only: nothing here loads weights or touches JAX.

A model's name is what a request sends (``GenerateRequest.model``): a folder's or file's name without its
extension; a built-in name or a hub id as given. Its A1111 hash (the first 10 hex digits of the sha256 of its
file, or of its weight files in order for a folder) is computed lazily on a background thread and cached, so a
listing never waits for a 7 GB file to be hashed (:meth:`Catalogue.info` says ``hash=None`` meanwhile).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from sdxl_engine.checkpoint import builtin, single_file
from sdxl_engine.checkpoint.weights import ModelLoadError
from sdxl_engine.config import ConfigError

LOG = logging.getLogger(__name__)

MODEL, REFINER = "--model", "--refiner"  # an entry's flag: which list it is in, as errors name it
HASH_CHUNK = 1 << 24  # bytes read at a time when hashing


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One model a server offers.

    Attributes:
        name: what requests name it by (:func:`entry_name`).
        spec: what ``loading.load_model`` reads: a built-in name, a folder, a hub id or a ``.safetensors`` file.
        flag: ``--model`` or ``--refiner`` (which list it is in; errors name it).
        from_dir: whether ``--models-dir`` / ``--refiners-dir`` found it (a rescan may drop it) rather than a flag.
    """

    name: str
    spec: str
    flag: str = MODEL
    from_dir: bool = False

    @property
    def filename(self) -> str:
        """The local file or folder it is read from, "" for a built-in made in memory or a hub id."""
        if self.spec in builtin.BUILTIN_NAMES:
            return str(builtin.TINY_SHAPES_DIR) if self.spec == "tiny-shapes" else ""
        path = Path(self.spec).expanduser()
        return str(path.resolve()) if path.exists() else ""


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a listing shows of one model (A1111's ``/sdapi/v1/sd-models`` entry: title, model_name, hash, sha256,
    filename).

    Attributes:
        name: the model's name (A1111's ``model_name``).
        title: ``"name [hash]"``, or the name alone while the hash is unknown (A1111's rule).
        hash: the first 10 hex digits of ``sha256``, or None (not computed yet, or no file: a built-in made in
            memory, a hub id).
        sha256: of the file, or of a folder's weight files read in order (relative path order); None as ``hash``.
        filename: the file or folder ("" for none).
        refiner: whether it is in the refiners' list.
        default: whether it is the default (the first ``--model``).
    """

    name: str
    title: str
    hash: str | None
    sha256: str | None
    filename: str
    refiner: bool = False
    default: bool = False


def entry_name(spec: str) -> str:
    """The name requests use for ``spec``: a local folder's or file's name without the extension (A1111's
    model_name), a built-in name or a hub id (``owner/name``) as given, a hub file's name without extension."""
    if spec in builtin.BUILTIN_NAMES:
        return spec
    path = Path(spec).expanduser()
    if path.exists():
        path = path.resolve()
        return path.stem if path.is_file() else path.name
    if single_file.is_single_file_name(spec):  # owner/name/file.safetensors on the hub
        return Path(spec).stem
    return spec


def _is_model_folder(path: Path) -> bool:
    return path.is_dir() and (path / "model_index.json").is_file()


def _folder_is_refiner(path: Path) -> bool:
    """Whether a diffusers folder's model_index.json declares no ``text_encoder`` (an SDXL refiner's: [null, null]);
    unreadable: False (loading it says what is wrong)."""
    try:
        index = json.loads((path / "model_index.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(index, dict) and index.get("text_encoder") in (None, [None, None])


def scan_dir(folder: str, flag: str = MODEL, log: Callable[[str], None] = LOG.info) -> list[ModelEntry]:
    """The models in ``folder``, by name: each subfolder with a ``model_index.json`` and each SDXL
    ``.safetensors`` file (its header read: a LoRA, a UNet alone or another architecture is skipped with one log
    line; a base-type file for ``--models-dir``, a refiner file for ``--refiners-dir``). "" = none.

    Raises ConfigError: ``folder`` is not a folder."""
    if not folder:
        return []
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{flag}s-dir {folder!r}: not a folder")
    entries = []
    for path in sorted(root.iterdir()):
        if _is_model_folder(path):
            refiner = _folder_is_refiner(path)
        elif path.is_file() and single_file.is_single_file_name(path.name):
            try:
                refiner = single_file.inspect_checkpoint(path).refiner
            except ModelLoadError as err:
                log(f"[sdxl_engine] {flag}s-dir: skipped {path.name}: {err}")
                continue
        else:
            continue
        if refiner != (flag == REFINER):
            log(f"[sdxl_engine] {flag}s-dir: skipped {path.name}: "
                f"{'an SDXL refiner' if refiner else 'not an SDXL refiner'}")
            continue
        entries.append(ModelEntry(path.stem if path.is_file() else path.name, str(path), flag, from_dir=True))
    return entries


def entries(specs: Iterable[str], folder: str = "", flag: str = MODEL,
            log: Callable[[str], None] = LOG.info) -> dict[str, ModelEntry]:
    """{name: ModelEntry} of the flags' ``specs`` in order (the first is the default), then ``folder``'s
    (:func:`scan_dir`). A folder's model of a name a flag gave already is the flag's.

    Raises ConfigError: two flags' specs with one name (naming both)."""
    found: dict[str, ModelEntry] = {}
    for spec in specs:
        entry = ModelEntry(entry_name(spec), spec, flag)
        if entry.name in found:
            raise ConfigError(f"{flag} {spec!r} and {flag} {found[entry.name].spec!r} are both named "
                              f"{entry.name!r}; a request names a model by its folder's or file's name, so each "
                              "name once (rename a folder or a file)")
        found[entry.name] = entry
    for entry in scan_dir(folder, flag, log):
        found.setdefault(entry.name, entry)
    return found


def split_specs(text: str, separator: str = os.pathsep) -> list[str]:
    """A setting holding several models (``models``, ``refiners``: entries joined by os.pathsep, as the repeated
    flag writes them) as a list, empty entries dropped."""
    return [part.strip() for part in text.split(separator) if part.strip()]


def weight_files(entry: ModelEntry, cache_dir: str = "") -> list[Path]:
    """The files whose bytes make ``entry``'s hash: a single file itself; a folder's ``.safetensors`` (and Flax
    msgpack) files in relative path order; a built-in tiny-random's folder in ``cache_dir`` once made; [] for a
    built-in made in memory or a hub id."""
    if entry.spec == "tiny-random":
        folder = Path(cache_dir) / "tiny-random-v3" if cache_dir else None
    elif entry.spec == "sdxl-base-random":
        return []
    else:
        folder = Path(entry.filename) if entry.filename else None
    if folder is None or not folder.exists():
        return []
    if folder.is_file():
        return [folder]
    return sorted((p for p in folder.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".msgpack")),
                  key=lambda p: p.relative_to(folder).as_posix())


def sha256_of(files: Iterable[Path]) -> str:
    """The sha256 of the files' bytes read one after the other (A1111's model hash, for one file)."""
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as handle:
            while chunk := handle.read(HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


class Catalogue:
    """The models and refiners a server offers, by name, and their hashes (computed once, on a daemon thread).

    Args:
        models: the ``--model`` specs in order (the first is the default); models_dir: ``--models-dir`` ("" none).
        refiners, refiners_dir: the same for ``--refiner``.
        cache_dir: the built-in models' folder (tiny-random's files are hashed from there).

    Thread-safe: a rescan (:meth:`rescan`) swaps the tables under a lock while requests read them.
    """

    def __init__(self, models: Iterable[str], models_dir: str = "", refiners: Iterable[str] = (),
                 refiners_dir: str = "", cache_dir: str = "", log: Callable[[str], None] = LOG.info):
        self._specs, self._refiner_specs = list(models), list(refiners)
        if not self._specs:
            raise ConfigError("model: at least one model is needed")
        self.models_dir, self.refiners_dir, self.cache_dir, self._log = models_dir, refiners_dir, cache_dir, log
        self._lock = threading.Lock()
        self._hashes: dict[str, str | None] = {}  # spec -> sha256 (None: no file to hash)
        self._hashing: threading.Thread | None = None
        self.models: dict[str, ModelEntry] = {}
        self.refiners: dict[str, ModelEntry] = {}
        self.rescan()

    @property
    def default(self) -> str:
        """The default model's name (the first ``--model``)."""
        return entry_name(self._specs[0])

    def rescan(self) -> tuple[list[str], list[str]]:
        """Read the folders again (A1111's ``/sdapi/v1/refresh-checkpoints``): models added to or removed from
        ``--models-dir`` / ``--refiners-dir`` since; the flags' models stay. Returns (added, removed) names."""
        models = entries(self._specs, self.models_dir, MODEL, self._log)
        refiners = entries(self._refiner_specs, self.refiners_dir, REFINER, self._log)
        with self._lock:
            before = set(self.models) | {f"refiner:{n}" for n in self.refiners}
            self.models, self.refiners = models, refiners
            after = set(models) | {f"refiner:{n}" for n in refiners}
        return sorted(after - before), sorted(before - after)

    def model(self, name: str | None) -> ModelEntry:
        """The entry of model ``name`` (None: the default). Raises KeyError for an unknown name."""
        with self._lock:
            return self.models[self.default if name is None else name]

    def refiner(self, name: str | None) -> ModelEntry:
        """The entry of refiner ``name`` (None: the first). Raises KeyError for an unknown name or none at all."""
        with self._lock:
            if name is None:
                return next(iter(self.refiners.values()))
            return self.refiners[name]

    def names(self, refiners: bool = False) -> list[str]:
        """The models' (or refiners') names, the default first, then the flags' order, then the folder's."""
        with self._lock:
            return list(self.refiners if refiners else self.models)

    def info(self, name: str, refiners: bool = False) -> ModelInfo:
        """``name``'s listing entry; its hash is None until the background hashing reached it (started by the
        first call). Raises KeyError for an unknown name."""
        entry = self.refiner(name) if refiners else self.model(name)
        self._start_hashing()
        with self._lock:
            sha = self._hashes.get(entry.spec)
        short = sha[:10] if sha else None
        return ModelInfo(entry.name, f"{entry.name} [{short}]" if short else entry.name, short, sha, entry.filename,
                         refiner=refiners, default=not refiners and entry.name == self.default)

    def infos(self, refiners: bool = False) -> list[ModelInfo]:
        """:meth:`info` of every model (or refiner), in :meth:`names`' order."""
        return [self.info(name, refiners) for name in self.names(refiners)]

    def find(self, text: str) -> str | None:
        """The model a client's text names: a name, or an A1111 title ``"name [hash]"`` (its name part; a hash that
        is known and differs does not match), or None."""
        text = text.strip()
        with self._lock:
            if text in self.models:
                return text
        name, _, rest = text.rpartition(" [")
        if not name or not rest.endswith("]"):
            return None
        with self._lock:
            entry = self.models.get(name)
            sha = None if entry is None else self._hashes.get(entry.spec)
        if entry is None or (sha and not sha.startswith(rest[:-1].lower())):
            return None
        return name

    def wait_hashes(self, timeout: float | None = None) -> None:
        """Block until every entry known when hashing started is hashed (tests, tools)."""
        self._start_hashing()
        thread = self._hashing
        if thread is not None:
            thread.join(timeout)

    def _start_hashing(self) -> None:
        with self._lock:
            todo = [e for e in (*self.models.values(), *self.refiners.values()) if e.spec not in self._hashes]
            if not todo or (self._hashing is not None and self._hashing.is_alive()):
                return
            self._hashing = threading.Thread(target=self._hash_all, args=(todo,), name="model-hashes", daemon=True)
            self._hashing.start()

    def _hash_all(self, todo: list[ModelEntry]) -> None:
        for entry in todo:
            try:
                files = weight_files(entry, self.cache_dir)
                sha = sha256_of(files) if files else None
            except OSError as err:  # a file removed or unreadable: no hash, one line; the next listing retries
                self._log(f"[sdxl_engine] could not hash {entry.name}: {err}")
                continue
            with self._lock:
                self._hashes[entry.spec] = sha
