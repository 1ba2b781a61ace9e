"""Compiled programs kept on disk between runs: serialized XLA executables, loaded only when trusted.

JAX's persistent compilation cache (:func:`.config.apply_jax_options`) saves XLA's compile, but
to find its entry a restart still traces the program and lowers it to StableHLO (the key is a
hash of the lowered module). This cache stores the compiled executable itself
(``jax.experimental.serialize_executable``) under a key computed without tracing, so a warm start
loads it and neither traces, lowers nor compiles.

Layout, in ``<compile_cache_dir>/executables/`` (mode 0700)::

    manifest.json   {"format": 1, "entries": {digest: entry}, "pruned": [digest]}   mode 0600
    secret          32 random bytes, made by the first process here                  mode 0600
    lock            flock(2) target: writers exclusive, readers shared               mode 0600
    <digest>.xla    one serialized executable                                        mode 0600

``digest`` is the SHA-256 of the key (the caller's dict plus :func:`runtime_key`, as canonical
JSON). An entry holds the key, the file's size and SHA-256, the writer's uid and an HMAC-SHA256
of all of that under ``secret``. ``pruned`` lists the digests of the last entries pruning removed (at most
:data:`MAX_PRUNED`), so that a miss for one says so rather than naming a field that differs from another entry's.

A serialized executable unpickles: loading a file someone else wrote runs their code. So a file
is deserialized only when every check below passes; on the first that fails, :meth:`load`
returns None and a one-line reason, and the caller compiles again (and stores the fresh
executable over the entry):

1. the folder is a real folder (not a symlink) owned by this user and writable by no one else;
2. ``manifest.json`` and ``secret`` are regular files owned by this user, mode 0600;
3. the manifest lists the key's digest, with a valid HMAC: an entry another installation wrote
   (another secret), or one edited by hand, is *foreign* and refused;
4. ``<digest>.xla`` is a regular file owned by this user, mode 0600, of the listed size and
   SHA-256 (the bytes that were hashed are the bytes deserialized: no second read);
5. it deserializes without an error.

An executable with host callbacks is not stored: their handlers do not survive serialization on every
backend (a TPU's deserialized executable aborted the process at its first callback), and no program of this
engine compiles one (the per-step hook runs on the host between executables: compiling.SteppedExecutable).

A start loads the same executables as the start before it with the same configuration, so it need not wait for
its weights to learn their keys: :meth:`ExecutableCache.finish_start` records which entries a start loaded or stored
(``starts.json``, mode 0600, under a name the engine makes of its configuration and :func:`runtime_key`), and the
next start of that name deserializes them on threads (:meth:`ExecutableCache.preload`) while its weights load; its
:meth:`~ExecutableCache.load` then takes the preloaded executable instead of reading the file. The record only
says what to read early: a preload passes every check above (an entry it names that fails one is not deserialized),
and :meth:`~ExecutableCache.load` takes a preloaded executable only for its own key's digest and only when the
manifest's HMAC-checked SHA-256 is still that of the bytes the preload deserialized. What a start preloaded and did
not use is dropped at :meth:`~ExecutableCache.finish_start`.

Nothing here raises for a bad or missing cache: the cache only ever saves time.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import fcntl
import hashlib
import hmac
import json
import os
import platform
import secrets
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jaxlib.version
from jax.experimental import serialize_executable

FORMAT = 1  # of the manifest and of the key; a new format makes every old entry a miss
MAX_ENTRIES = 32  # the oldest entries (and their files) beyond this many are deleted when one is stored
MAX_STARTS = 16  # starts.json keeps the newest records of this many start names
KEPT_STARTS = 4  # the entries the newest this many start records name are never pruned (beyond MAX_ENTRIES if need be)
MAX_PRUNED = 256  # the manifest's "pruned" keeps the digests of this many pruned entries (a miss's note only)
# JAX options that change what a traced program lowers to; XLA_FLAGS and LIBTPU_INIT_ARGS change the compile.
JAX_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
               "jax_threefry_partitionable", "jax_use_shardy_partitioner")
ENV_OPTIONS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
# The order in which a miss names what changed (the first differing field of the newest stored entry).
_WHAT_CHANGED = ("format", "jax", "jaxlib", "python", "backend", "platform_version", "device_kind", "device_count",
                 "process_count", "cpu", "jax_options", "environment", "source", "model", "dtype", "params", "mesh",
                 "shape")


class Untrusted(Exception):
    """A cache file failed a safety check (the message says which); it is not deserialized."""


def runtime_key(devices: Sequence[Any]) -> dict[str, Any]:
    """What the executable depends on besides the program: versions, backend, devices, options.

    ``cpu`` (CPU backends only) hashes the host CPU's feature flags, so an executable compiled
    for one CPU (AVX-512, say) is never loaded on another that lacks them.
    """
    first = devices[0]
    return {
        "format": FORMAT,
        "jax": jax.__version__,
        "jaxlib": jaxlib.version.__version__,
        "python": platform.python_version(),
        "backend": first.platform,
        "platform_version": first.client.platform_version,
        "device_kind": first.device_kind,
        "device_count": len(devices),
        "process_count": jax.process_count(),
        "cpu": _cpu_flags() if first.platform == "cpu" else "",
        "jax_options": {name: str(getattr(jax.config, name, None)) for name in JAX_OPTIONS},
        "environment": {name: os.environ.get(name, "") for name in ENV_OPTIONS},
    }


def _cpu_flags() -> str:
    """SHA-256 (16 hex digits) of the machine name and /proc/cpuinfo's first ``flags`` line ("" where absent)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:  # not Linux: the machine name alone
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:16]


def key_digest(key: dict[str, Any]) -> str:
    """SHA-256 hex digest of ``key`` as canonical JSON (sorted keys; non-JSON values as ``str``)."""
    return hashlib.sha256(_canonical(key)).hexdigest()


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def source_digest(paths: Sequence[Path], root: Path | None = None) -> str:
    """SHA-256 (16 hex digits) of the files' names and contents, in the order given.

    A file's name is its path relative to ``root`` when given (so moving a file to another folder
    is a new digest), else its base name.
    """
    h = hashlib.sha256()
    for path in paths:
        name = path.relative_to(root).as_posix() if root is not None else path.name
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@dataclasses.dataclass
class Lookup:
    """What :meth:`ExecutableCache.load` found.

    Attributes:
        executable: the loaded ``jax.stages.Compiled``, or None (compile instead).
        note: one line: ``loaded <file>``, or why nothing was loaded (``miss: ...``,
            ``refused <file>: ...``, ``<file> did not deserialize: ...``).
        seconds: time spent checking and deserializing.
    """

    executable: Any
    note: str
    seconds: float


class ExecutableCache:
    """Serialized executables in one folder, written and read under the rules of the module docstring."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.manifest_path = self.directory / "manifest.json"
        self.secret_path = self.directory / "secret"
        self.starts_path = self.directory / "starts.json"
        self._lock = threading.Lock()
        self._preloaded: dict[str, concurrent.futures.Future] = {}  # digest: Future of (sha256, Compiled) or None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._used: list[str] = []  # digests loaded or stored, in order (what finish_start records)
        self._taken = 0  # preloaded executables load() used

    # ---- reading ------------------------------------------------------------------------------
    def load(self, key: dict[str, Any], in_tree, out_tree, devices: Sequence[Any]) -> Lookup:
        """The executable stored for ``key``, if every safety check passes.

        Args:
            key: the program's key (JSON-able dict; its ``"program"`` entry names it in notes);
                :func:`runtime_key` of ``devices`` is added here.
            in_tree, out_tree: the executable's argument pytree (``((args...), {})``) and
                output pytree, rebuilt by the caller without tracing.
            devices: the devices the executable runs on (the mesh's, in mesh order).
        Returns:
            a :class:`Lookup`; ``executable`` is None on a miss or a refusal.
        """
        start = time.perf_counter()
        key = {**key, **runtime_key(devices)}
        digest = key_digest(key)
        name = f"{digest}.xla"
        preloaded = self._take_preloaded(digest)
        try:
            if not self.directory.exists():
                return Lookup(None, "miss: nothing stored yet", time.perf_counter() - start)
            with self._locked_folder():
                manifest = self._read_manifest()
                if manifest is None:
                    return Lookup(None, "miss: no manifest yet", time.perf_counter() - start)
                entry = manifest["entries"].get(digest)
                if entry is None:
                    return Lookup(None, f"miss: {_why_missing(manifest, key, digest)}", time.perf_counter() - start)
                self._check_entry(digest, entry)
                if preloaded is not None and preloaded[0] == entry.get("sha256"):
                    executable = _with_trees(preloaded[1], in_tree, out_tree)
                    if executable is not None:
                        self._note_used(digest, preloaded=True)
                        return Lookup(executable, f"loaded {self.directory / name} (preloaded)",
                                      time.perf_counter() - start)
                blob = _read_private(self.directory / name)
        except Untrusted as err:
            return Lookup(None, f"refused {name}: {err}", time.perf_counter() - start)
        except FileNotFoundError as err:
            return Lookup(None, f"refused {name}: {Path(err.filename).name} is missing", time.perf_counter() - start)
        except OSError as err:
            return Lookup(None, f"refused {name}: {type(err).__name__}: {err}", time.perf_counter() - start)
        if len(blob) != entry.get("bytes") or hashlib.sha256(blob).hexdigest() != entry.get("sha256"):
            return Lookup(None, f"refused {name}: its size or SHA-256 differs from the manifest's (changed on disk)",
                          time.perf_counter() - start)
        try:
            if entry.get("host_callbacks"):  # written by an engine that compiled its step hook in
                return Lookup(None, f"miss: {name} calls the host", time.perf_counter() - start)
            executable = serialize_executable.deserialize_and_load(
                blob, in_tree, out_tree, backend=devices[0].client, execution_devices=list(devices))
        except Exception as err:  # whatever XLA or the unpickler raise for a stale format: compile instead
            return Lookup(None, f"{name} did not deserialize ({type(err).__name__}: {_first_line(err)})",
                          time.perf_counter() - start)
        self._note_used(digest)
        return Lookup(executable, f"loaded {self.directory / name}", time.perf_counter() - start)

    @contextmanager
    def _locked_folder(self) -> Iterator[None]:
        """The folder checked (rule 1; raises Untrusted), then a shared lock on it for reading."""
        _check_private(os.lstat(self.directory), self.directory, folder=True)
        with self._locked(fcntl.LOCK_SH):
            yield

    def _check_entry(self, digest: str, entry: Any) -> None:
        """Rule 3 for a listed entry: raises Untrusted unless its HMAC is this installation's."""
        if not isinstance(entry, dict):
            raise Untrusted("its manifest entry is not an object")
        if not hmac.compare_digest(str(entry.get("mac", "")), _mac(self._read_secret(), digest, entry)):
            raise Untrusted("its manifest entry was not written by this installation (the HMAC does not "
                            "match this cache's secret)")

    # ---- a start's executables, read while its weights load -------------------------------------
    def preload(self, start: str, devices: Sequence[Any], threads: int = 3) -> int:
        """Deserialize, on up to ``threads`` threads, the executables the last start named ``start`` loaded or
        stored (``starts.json``), each only if it passes every check of :meth:`load`; :meth:`load` takes them.

        Args:
            start: the start's name (the engine's: a digest of its configuration and :func:`runtime_key`).
            devices: the devices they run on (the mesh's, in mesh order).
        Returns:
            how many are being read (0: no record, or an unreadable one).
        """
        try:
            with self._locked_folder():
                record = json.loads(_read_private(self.starts_path)).get("starts", {}).get(start)
            digests = [d for d in record["digests"] if isinstance(d, str)]
        except Exception:  # noqa: BLE001  no record, or one that is not ours or not JSON: nothing to read early
            return 0
        with self._lock:
            digests = [d for d in dict.fromkeys(digests) if d not in self._preloaded]
            if not digests:
                return 0
            self._pool = self._pool or concurrent.futures.ThreadPoolExecutor(max(1, threads),
                                                                             thread_name_prefix="preload")
            for digest in digests:
                self._preloaded[digest] = self._pool.submit(self._preload_one, digest, list(devices))
        return len(digests)

    def _preload_one(self, digest: str, devices: list) -> tuple[str, Any] | None:
        """(SHA-256 of the bytes deserialized, the executable with flat argument infos), or None for any failure
        (:meth:`load` then reads the file itself and says why)."""
        try:
            with self._locked_folder():
                manifest = self._read_manifest()
                entry = None if manifest is None else manifest["entries"].get(digest)
                if entry is None:
                    return None
                self._check_entry(digest, entry)
                blob = _read_private(self.directory / f"{digest}.xla")
            sha = hashlib.sha256(blob).hexdigest()
            if len(blob) != entry.get("bytes") or sha != entry.get("sha256") or entry.get("host_callbacks"):
                return None
            return sha, serialize_executable.deserialize_and_load(blob, _FlatTree, None, backend=devices[0].client,
                                                                  execution_devices=devices)
        except Exception:  # noqa: BLE001  load() repeats the checks and names what failed
            return None

    def _take_preloaded(self, digest: str) -> tuple[str, Any] | None:
        """The preload of ``digest`` (waited for), once; None if there was none or it failed."""
        with self._lock:
            future = self._preloaded.pop(digest, None)
        return None if future is None else future.result()

    def _note_used(self, digest: str, preloaded: bool = False) -> None:
        with self._lock:
            self._used.append(digest)
            self._taken += preloaded

    def finish_start(self, start: str | None) -> tuple[int, int]:
        """End a start: drop what was preloaded and not taken, and (``start`` given: the start succeeded) record
        the entries loaded or stored since this cache was made under ``start`` in ``starts.json`` for the next
        start of that name. Never raises.

        Returns:
            (preloaded executables taken, preloaded ones dropped).
        """
        with self._lock:
            left, self._preloaded = list(self._preloaded.values()), {}
            used, pool, self._pool = list(dict.fromkeys(self._used)), self._pool, None
            taken, self._taken = self._taken, 0
        for future in left:
            future.cancel()
        if pool is not None:
            pool.shutdown(wait=True)
        dropped = sum(1 for f in left if not f.cancelled() and f.result() is not None)
        if start and used:
            try:
                with self._locked(fcntl.LOCK_EX):
                    _check_private(os.lstat(self.directory), self.directory, folder=True)
                    try:
                        starts = json.loads(_read_private(self.starts_path)).get("starts", {})
                    except Exception:  # noqa: BLE001  none yet, or not ours: written anew
                        starts = {}
                    starts = {k: v for k, v in starts.items() if isinstance(v, dict) and k != start}
                    starts[start] = {"digests": used, "written": time.time()}
                    newest = sorted(starts, key=lambda k: _stamp(starts[k]))[-MAX_STARTS:]
                    _write_private(self.starts_path, _canonical({"starts": {k: starts[k] for k in newest}}))
            except Exception:  # noqa: BLE001  unwritable, or a record edited out of shape: the next start reads its
                pass  # files when it needs them, as without a record
        return taken, dropped

    def _read_manifest(self) -> dict | None:
        """The manifest (None if absent). Raises Untrusted for a foreign, open or unreadable one."""
        try:
            raw = _read_private(self.manifest_path)
        except FileNotFoundError:
            return None
        try:
            manifest = json.loads(raw)
        except ValueError as err:
            raise Untrusted(f"manifest.json is not JSON ({err})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(
                manifest.get("entries"), dict):
            raise Untrusted(f"manifest.json is not format {FORMAT}")
        return manifest

    def _read_secret(self) -> bytes:
        secret = _read_private(self.secret_path)
        if len(secret) != 32:
            raise Untrusted("secret is not 32 bytes")
        return secret

    # ---- writing ------------------------------------------------------------------------------
    def store(self, key: dict[str, Any], compiled, devices: Sequence[Any], in_tree=None, out_tree=None) -> str:
        """Serialize ``compiled`` under ``key`` (plus :func:`runtime_key` of ``devices``).

        ``in_tree``/``out_tree``, if given, must equal the executable's own pytrees (what
        :meth:`load` will be handed); otherwise nothing is stored, since it could never load.

        Returns:
            one line for the log: ``stored <file> (N MB)`` or ``not stored: <why>``.
        """
        key = {**key, **runtime_key(devices)}
        digest = key_digest(key)
        try:
            if getattr(getattr(compiled._executable, "_unloaded_executable", None), "host_callbacks", ()):
                return "not stored: it calls the host (its callbacks' handlers would not survive loading)"
            blob, own_in, own_out = serialize_executable.serialize(compiled)
        except Exception as err:  # backends and programs that cannot serialize raise various types
            return f"not stored: {type(err).__name__}: {_first_line(err)}"
        if (in_tree is not None and own_in != in_tree) or (out_tree is not None and own_out != out_tree):
            return "not stored: the executable's pytrees differ from those the loader rebuilds"
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            _check_private(os.lstat(self.directory), self.directory, folder=True)
            with self._locked(fcntl.LOCK_EX):
                secret = self._secret()
                try:
                    manifest = self._read_manifest() or {"format": FORMAT, "entries": {}}
                    dropped = ""
                except Untrusted as err:  # rewritten from scratch: its entries are not loaded anyway
                    manifest, dropped = {"format": FORMAT, "entries": {}}, f"; replaced the manifest ({err})"
                path = self.directory / f"{digest}.xla"
                _write_private(path, blob)
                entry = {"key": key, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
                         "uid": os.getuid(), "written": time.time()}
                entry["mac"] = _mac(secret, digest, entry)
                manifest["entries"][digest] = entry
                gone = self._prune(manifest["entries"])
                earlier = manifest.get("pruned") if isinstance(manifest.get("pruned"), list) else []
                pruned = [d for d in earlier if isinstance(d, str) and d != digest and d not in gone] + gone
                if pruned:  # what a later miss for one of them names (_why_missing)
                    manifest["pruned"] = pruned[-MAX_PRUNED:]
                else:
                    manifest.pop("pruned", None)
                _write_private(self.manifest_path, _canonical(manifest))
        except (OSError, Untrusted) as err:
            return f"not stored: {type(err).__name__}: {err}"
        self._note_used(digest)
        return f"stored {path} ({len(blob) / 1e6:.1f} MB){dropped}"

    def _secret(self) -> bytes:
        """This cache's HMAC key, made on first use (call with the lock held)."""
        try:
            return self._read_secret()
        except FileNotFoundError:
            _write_private(self.secret_path, secrets.token_bytes(32))
            return self._read_secret()

    def _prune(self, entries: dict[str, dict]) -> list[str]:
        """Drop the oldest entries beyond MAX_ENTRIES, and their files, but never one that the newest
        :data:`KEPT_STARTS` start records name (``starts.json``): a server that compiled other sizes since its last
        start would otherwise lose the very executables its next start loads first (found by a new user: ten
        programs of three executables filled the cache, and the default size's were the oldest).

        Returns:
            the digests dropped, oldest first.
        """
        def written(digest: str) -> float:
            entry = entries[digest]
            stamp = entry.get("written") if isinstance(entry, dict) else None
            return stamp if isinstance(stamp, (int, float)) else 0

        kept = self._recorded()
        gone = [d for d in sorted(entries, key=written) if d not in kept][:-MAX_ENTRIES]
        for digest in gone:
            del entries[digest]
            (self.directory / f"{digest}.xla").unlink(missing_ok=True)
        return gone

    def _recorded(self) -> set[str]:
        """The digests the newest :data:`KEPT_STARTS` start records name (none where starts.json is absent or not
        ours)."""
        try:
            starts = json.loads(_read_private(self.starts_path)).get("starts", {})
            newest = sorted((v for v in starts.values() if isinstance(v, dict)), key=_stamp)
            return {d for record in newest[-KEPT_STARTS:] for d in record.get("digests", []) if isinstance(d, str)}
        except Exception:  # noqa: BLE001  no record: nothing is kept beyond MAX_ENTRIES' rule
            return set()

    @contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        """flock(2) on ``lock`` (shared for readers, exclusive for writers); no-op if it cannot be made."""
        try:
            fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError:  # a read-only cache folder: readers need no lock to be safe (files are replaced atomically)
            fd = None
        try:
            if fd is not None:
                fcntl.flock(fd, mode)
            yield
        finally:
            if fd is not None:
                os.close(fd)


def _mac(secret: bytes, digest: str, entry: dict) -> str:
    body = {k: v for k, v in entry.items() if k != "mac"}
    return hmac.new(secret, digest.encode() + b"\0" + _canonical(body), hashlib.sha256).hexdigest()


def _check_private(st: os.stat_result, path: Path, folder: bool = False) -> None:
    """Raise Untrusted unless ``st`` is a regular file (a folder if ``folder``) owned by this user,
    mode 0600 (a folder: writable by no one else)."""
    if folder and not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{path} is not a folder (a symlink?)")
    if not folder and not stat.S_ISREG(st.st_mode):
        raise Untrusted(f"{path.name} is not a regular file")
    if st.st_uid != os.getuid():
        raise Untrusted(f"{path.name} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    mode = stat.S_IMODE(st.st_mode)
    if folder and mode & 0o022:
        raise Untrusted(f"{path} is writable by others (mode {mode:04o})")
    if not folder and mode != 0o600:
        raise Untrusted(f"{path.name} has mode {mode:04o}, not 0600")


def _read_private(path: Path) -> bytes:
    """The bytes of ``path``, checked on the open descriptor (no symlink, owner, mode 0600).

    Raises FileNotFoundError, Untrusted or OSError.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW on a symlink
            raise Untrusted(f"{path.name} is a symlink") from None
        raise
    with os.fdopen(fd, "rb") as f:
        _check_private(os.fstat(f.fileno()), path)
        return f.read()


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new 0600 file beside ``path``, then rename it over ``path`` (atomic)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _why_missing(manifest: dict, key: dict[str, Any], digest: str) -> str:
    """Why no entry of ``manifest`` matches ``key`` (whose digest is ``digest``): pruning removed its entry (the
    manifest's ``pruned`` names it: the very key was stored, so nothing changed), else what differs from the newest
    entry stored for the same program."""
    pruned = manifest.get("pruned")
    if isinstance(pruned, list) and digest in pruned:
        return (f"removed by the cache's pruning (it keeps the newest {MAX_ENTRIES} entries, and those the last "
                f"{KEPT_STARTS} starts loaded)")
    entries = manifest["entries"]
    same = [e for e in entries.values()
            if isinstance(e, dict) and isinstance(e.get("key"), dict) and e["key"].get("program") == key.get("program")]
    if not same:
        return "nothing stored for this program yet"
    old = max(same, key=lambda e: e["written"] if isinstance(e.get("written"), (int, float)) else 0)["key"]
    for field in _WHAT_CHANGED:
        if old.get(field) != key.get(field):
            was, now = old.get(field), key.get(field)
            if isinstance(was, (dict, list)) or isinstance(now, (dict, list)) or field in ("cpu", "source"):
                return f"stored for another {field} (changed since it was written)"
            return f"stored for {field} {was}, this is {now}"
    return "stored under another key"


def _stamp(record: dict) -> float:
    """A start record's ``written`` time (0 where it is not a number)."""
    stamp = record.get("written")
    return stamp if isinstance(stamp, (int, float)) and not isinstance(stamp, bool) else 0


class _FlatTree:
    """What :meth:`ExecutableCache.preload` hands ``deserialize_and_load`` for the argument pytree it does not know
    yet: the executable keeps its argument infos flat, and :func:`_with_trees` gives it the caller's pytrees."""

    @staticmethod
    def unflatten(leaves):
        return list(leaves)


def _with_trees(compiled, in_tree, out_tree):
    """``compiled`` (deserialized with :class:`_FlatTree`) with the caller's argument and output pytrees: the
    ``jax.stages.Compiled`` that ``deserialize_and_load`` would have made with them; None if they do not fit."""
    try:
        return jax.stages.Compiled(compiled._executable, [], in_tree.unflatten(compiled.args_info), out_tree,
                                   no_kwargs=compiled._no_kwargs)
    except Exception:  # noqa: BLE001  another leaf count, or a JAX whose Compiled differs: read the file instead
        return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else ""
