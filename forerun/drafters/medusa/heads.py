"""Medusa heads (Cai et al. 2024): extra decoding heads on the target's own
last hidden state, each guessing one token further ahead.

Head ``i`` (0-based) reads the final-norm hidden state ``h_t`` of position
``t`` and predicts token ``t + 2 + i`` (the model's own LM head predicts
``t + 1``).  It is a residual SiLU block followed by an LM head::

    y = h + SiLU(W_i h + b_i)        (medusa_num_layers such blocks)
    logits_i = lm_head(y)

The LM head is the base model's, shared and frozen, by default; a head may
carry its own (the original Medusa checkpoints do).  forerun's own files may
restrict the heads' output to a *candidate vocabulary* (the tokens seen in
training plus the base model's top predictions there): the drafter then
multiplies by those rows of the LM head only, which on a CPU makes drafting
~10x cheaper than a full-vocabulary LM head.  Candidates are proposals, never
outputs, so this changes speed, not what is generated.

Files
-----
* forerun's format: one ``.safetensors`` file, tensors named as in Medusa
  (``medusa_head.{i}.{l}.linear.weight`` / ``.bias``, optionally
  ``medusa_head.{i}.{L}.weight`` for an own LM head) plus an optional int32
  ``vocab`` (candidate vocabulary), and metadata ``format =
  forerun-medusa/1``, ``num_heads``, ``num_layers``, ``hidden_size``,
  ``vocab_size`` (the base model's), ``base_model`` and ``accuracy`` (JSON:
  held-out top-1/top-5 and per-rank hit rates, the tree policy's prior).
  The shared LM head is not stored.  Weights are stored in float16 and
  converted to the model's dtype on load.
* The original Medusa layout (FasterDecoding/Medusa): a folder with
  ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``) and
  ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt`` holding
  ``medusa_head.{i}.{l}.linear.weight/bias`` and ``medusa_head.{i}.{L}.weight``
  (the keys may also come without the ``medusa_head.`` prefix), or one of
  those files directly.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from forerun.decoding.draft_length import refine_seconds
from forerun.decoding.sampling import TokenSampler
from forerun.decoding.tree_speculative import TreeSpeculativeDecoding
from forerun.drafters.method_target import MethodOptions, MethodTarget, heads_file
from forerun.errors import ConfigError, ModelFormatError, ModelNotFoundError
from forerun.machine.json_files import read_json_object
from forerun.machine.output_files import (
    check_output_file,
    check_replaceable_file,
    written_whole,
)

FORMAT = "forerun-medusa/1"
ORIGINAL_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


@dataclass
class MedusaHeads:
    """The weights of ``num_heads`` Medusa heads.

    ``blocks[i]``: the ``(W, b)`` of each residual block of head ``i``
    (``W``: ``[H, H]``, ``b``: ``[H]``).  ``lm_heads``: ``None`` (use the base
    model's LM head) or one ``[V', H]`` matrix per head.  ``vocab``: ``None``
    (the rows of the LM head are the whole vocabulary) or the int64 token
    ids of the candidate vocabulary: row ``j`` of a head's logits is token
    ``vocab[j]``.  ``vocab_size``: the base model's vocabulary size the heads
    were made for (``None`` if unknown).  ``info``: metadata (base model,
    accuracies, training settings).
    """

    blocks: list[list[tuple[torch.Tensor, torch.Tensor]]]
    lm_heads: list[torch.Tensor] | None = None
    vocab: torch.Tensor | None = None
    vocab_size: int | None = None
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.blocks or any(not head for head in self.blocks):
            raise ModelFormatError("Medusa heads need at least one head of at least one block")
        h = self.hidden_size
        for i, head in enumerate(self.blocks):
            for j, (w, b) in enumerate(head):
                if tuple(w.shape) != (h, h) or tuple(b.shape) != (h,):
                    raise ModelFormatError(
                        f"Medusa head {i} block {j} has weight {tuple(w.shape)} and bias "
                        f"{tuple(b.shape)}; expected ({h}, {h}) and ({h},)")
        if self.lm_heads is not None:
            if len(self.lm_heads) != len(self.blocks):
                raise ModelFormatError(
                    f"{len(self.blocks)} Medusa heads but {len(self.lm_heads)} LM heads")
            rows = {tuple(m.shape) for m in self.lm_heads}
            if len(rows) != 1 or next(iter(rows))[1] != h:
                raise ModelFormatError(
                    f"the heads' own LM heads have shapes {sorted(rows)}; expected [V, {h}]")
        if self.vocab is not None:
            self.vocab = self.vocab.to(torch.long).reshape(-1)
            if self.vocab.numel() == 0:
                raise ModelFormatError("the candidate vocabulary of the Medusa heads is empty")
            if self.lm_heads is not None and self.lm_heads[0].shape[0] != self.vocab.numel():
                raise ModelFormatError(
                    f"the heads' LM heads have {self.lm_heads[0].shape[0]} rows but the "
                    f"candidate vocabulary has {self.vocab.numel()} tokens")

    # -- facts -------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    @property
    def num_layers(self) -> int:
        return len(self.blocks[0])

    @property
    def hidden_size(self) -> int:
        return int(self.blocks[0][0][0].shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0][0][0].dtype

    def rank_accuracy(self) -> list[list[float]] | None:
        """Held-out hit rate of each head's rank-``r`` candidate, if the file
        recorded it: ``[head][rank]``; measured on the model's own path (where
        the tokens before the guess are the model's) when available."""
        acc = self.info.get("accuracy") or {}
        hits = acc.get("own_path_rank_hits") or acc.get("rank_hits")
        return [list(map(float, row)) for row in hits] if hits else None

    # -- use -----------------------------------------------------------------
    def to(self, device: torch.device | str | None = None,
           dtype: torch.dtype | None = None) -> MedusaHeads:
        """A copy on ``device`` in ``dtype`` (the vocabulary stays int64)."""
        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype or t.dtype)

        return MedusaHeads(
            blocks=[[(cast(w), cast(b)) for w, b in head] for head in self.blocks],
            lm_heads=None if self.lm_heads is None else [cast(m) for m in self.lm_heads],
            vocab=None if self.vocab is None else self.vocab.to(device),
            vocab_size=self.vocab_size, info=dict(self.info))

    def check_base(self, hidden_size: int, vocab_size: int, name: str = "the model") -> None:
        """Raise :class:`ConfigError` unless these heads fit a base model of
        this hidden size and vocabulary."""
        if self.hidden_size != hidden_size:
            raise ConfigError(
                f"the Medusa heads read hidden states of size {self.hidden_size} but {name} "
                f"has hidden size {hidden_size}: they were trained for another model")
        if self.vocab_size is not None and self.vocab_size != vocab_size:
            raise ConfigError(
                f"the Medusa heads were made for a vocabulary of {self.vocab_size} tokens but "
                f"{name} has {vocab_size}: they were trained for another model")
        if self.vocab is not None and int(self.vocab.max()) >= vocab_size:
            raise ConfigError(
                f"the Medusa heads' candidate vocabulary holds token id "
                f"{int(self.vocab.max())}, outside {name}'s vocabulary of {vocab_size}")
        if self.lm_heads is not None and self.vocab is None \
                and self.lm_heads[0].shape[0] != vocab_size:
            raise ConfigError(
                f"the Medusa heads' LM heads have {self.lm_heads[0].shape[0]} rows but {name} "
                f"has a vocabulary of {vocab_size}: they were trained for another model")

    def head_states(self, hidden: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """``[heads, ..., H]``: each head's residual blocks applied to
        ``hidden`` (``[..., H]``)."""
        out = []
        for head in self.blocks[:heads or self.num_heads]:
            y = hidden
            for w, b in head:
                y = y + F.silu(F.linear(y, w, b))
            out.append(y)
        return torch.stack(out)

    def logits(self, hidden: torch.Tensor, base_lm_head: torch.Tensor | None,
               heads: int | None = None) -> torch.Tensor:
        """``[heads, ..., V']`` logits over the candidate vocabulary (the whole
        vocabulary when ``vocab`` is ``None``).  ``base_lm_head``: the base
        model's ``[V, H]`` LM head (needed unless the heads have their own)."""
        states = self.head_states(hidden, heads)
        if self.lm_heads is not None:
            return torch.stack([F.linear(s, m) for s, m in zip(states, self.lm_heads)])
        if base_lm_head is None:
            raise ConfigError("these Medusa heads share the base model's LM head: pass it")
        return F.linear(states, base_lm_head)

    # -- files ---------------------------------------------------------------
    def state_dict(self, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
        """Tensors in the Medusa naming (plus ``vocab``), in ``dtype``."""
        out: dict[str, torch.Tensor] = {}
        for i, head in enumerate(self.blocks):
            for j, (w, b) in enumerate(head):
                out[f"medusa_head.{i}.{j}.linear.weight"] = w.detach().to("cpu", dtype).contiguous()
                out[f"medusa_head.{i}.{j}.linear.bias"] = b.detach().to("cpu", dtype).contiguous()
            if self.lm_heads is not None:
                out[f"medusa_head.{i}.{len(head)}.weight"] = \
                    self.lm_heads[i].detach().to("cpu", dtype).contiguous()
        if self.vocab is not None:
            out["vocab"] = self.vocab.detach().to("cpu", torch.int32).contiguous()
        return out

    def save(self, path: str | Path, dtype: torch.dtype = torch.float16, *,
             force: bool = False) -> None:
        """Write forerun's format (see the module docstring).  An existing
        file at ``path`` is replaced only if it is forerun's Medusa file
        (:func:`is_medusa_file`), or with ``force``."""
        from safetensors.torch import save_file

        meta = {"format": FORMAT, "num_heads": str(self.num_heads),
                "num_layers": str(self.num_layers), "hidden_size": str(self.hidden_size),
                "shared_lm_head": "false" if self.lm_heads is not None else "true"}
        if self.vocab_size is not None:
            meta["vocab_size"] = str(self.vocab_size)
        for key, value in self.info.items():
            meta[key] = value if isinstance(value, str) else json.dumps(value)
        path = heads_path(path, "the heads' path", force=force)
        with written_whole(path) as tmp:
            save_file(self.state_dict(dtype), str(tmp), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> MedusaHeads:
        """Read forerun's format or the original Medusa layout (a folder with
        ``config.json``, or a ``medusa_lm_head.safetensors``/``.pt`` file)."""
        path = Path(path).expanduser()
        if not path.exists():
            raise ModelNotFoundError(f"Medusa heads {path} do not exist")
        config: dict = {}
        if path.is_dir():
            config = _read_config(path / "config.json")
            file = next((path / n for n in ORIGINAL_FILES if (path / n).is_file()), None)
            if file is None:
                raise ModelNotFoundError(
                    f"{path} holds no Medusa heads: expected {' or '.join(ORIGINAL_FILES)}")
        else:
            file = path
            if (path.parent / "config.json").is_file():
                config = _read_config(path.parent / "config.json")
        tensors, meta = _read_tensors(file)
        if meta.get("format") == FORMAT:
            return _from_forerun(tensors, meta, file)
        return _from_original(tensors, config, file)


def _read_config(path: Path) -> dict:
    return read_json_object(path, ModelFormatError, missing_ok=True)


def heads_path(path: str | Path, option: str, *, force: bool = False) -> Path:
    """``path`` as a place to write heads to (``option`` names it in the
    error): a file that can be written, and not a file forerun did not
    write unless ``force`` (:func:`is_medusa_file`)."""
    out = check_output_file(path, option)
    check_replaceable_file(out, option, "a Medusa heads file", is_medusa_file, force=force)
    return out


def is_medusa_file(path: Path) -> bool:
    """Whether ``path`` is a safetensors file in forerun's Medusa format (its
    metadata's format tag): a file forerun wrote and may write again."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except Exception:  # safetensors raises several types: not ours either way
        return False


def _read_tensors(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if file.suffix in (".pt", ".bin", ".pth"):
        try:
            state = torch.load(str(file), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types
            raise ModelFormatError(f"{file} is not a readable PyTorch checkpoint: {exc}") from exc
        if not isinstance(state, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
            raise ModelFormatError(f"{file} does not hold a state dict of tensors")
        return dict(state), {}
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises several types
        raise ModelFormatError(f"{file} is not a readable safetensors file: {exc}") from exc
    return tensors, meta


def _collect(tensors: dict[str, torch.Tensor], file: Path
             ) -> tuple[dict[int, dict[int, dict[str, torch.Tensor]]], set[str]]:
    """``heads[i][l][kind]`` from Medusa-named tensors; the other names."""
    heads: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    other = set()
    for key, t in tensors.items():
        name = key.removeprefix("medusa_head.")
        parts = name.split(".")
        if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
            kind = ".".join(parts[2:])
            if kind in ("linear.weight", "linear.bias", "weight"):
                heads.setdefault(int(parts[0]), {}).setdefault(int(parts[1]), {})[kind] = t
                continue
        other.add(key)
    if not heads:
        raise ModelFormatError(
            f"{file} holds no Medusa head tensors (expected names like "
            f"medusa_head.0.0.linear.weight)")
    return heads, other


def _assemble(heads, file: Path, num_heads: int | None, num_layers: int | None,
              need_lm_heads: bool):
    found = sorted(heads)
    if found != list(range(len(found))):
        raise ModelFormatError(f"{file} has Medusa heads {found}: not numbered 0..n-1")
    if num_heads is not None and num_heads > len(found):
        raise ModelFormatError(
            f"the config gives {num_heads} Medusa heads but {file} holds {len(found)}")
    n = num_heads or len(found)
    blocks, lm_heads = [], []
    for i in range(n):
        layers = heads[i]
        res = sorted(j for j, d in layers.items() if "linear.weight" in d)
        L = num_layers if num_layers is not None else len(res)
        if res[:L] != list(range(L)) or L == 0:
            raise ModelFormatError(
                f"Medusa head {i} in {file} has residual blocks {res}, expected 0..{L - 1}")
        head = []
        for j in range(L):
            d = layers[j]
            if "linear.bias" not in d:
                raise ModelFormatError(f"Medusa head {i} block {j} in {file} lacks its bias")
            head.append((d["linear.weight"], d["linear.bias"]))
        blocks.append(head)
        lm = layers.get(L, {}).get("weight")
        if lm is None and need_lm_heads:
            raise ModelFormatError(
                f"Medusa head {i} in {file} lacks its LM head medusa_head.{i}.{L}.weight")
        lm_heads.append(lm)
    have = [m is not None for m in lm_heads]
    if any(have) and not all(have):
        raise ModelFormatError(f"{file}: only some Medusa heads have their own LM head")
    return blocks, (lm_heads if all(have) else None)


def _from_forerun(tensors, meta, file: Path) -> MedusaHeads:
    heads, other = _collect(tensors, file)
    try:
        num_heads = int(meta["num_heads"])
        num_layers = int(meta["num_layers"])
        vocab_size = int(meta["vocab_size"]) if "vocab_size" in meta else None
    except (KeyError, ValueError) as exc:
        raise ModelFormatError(f"{file} lacks Medusa metadata {exc}") from exc
    blocks, lm_heads = _assemble(heads, file, num_heads, num_layers,
                                 need_lm_heads=meta.get("shared_lm_head") == "false")
    info = {}
    for key, value in meta.items():
        if key in ("format", "num_heads", "num_layers", "hidden_size", "vocab_size",
                   "shared_lm_head"):
            continue
        try:
            info[key] = json.loads(value)
        except ValueError:
            info[key] = value
    return MedusaHeads(blocks, lm_heads, tensors.get("vocab"), vocab_size, info)


def _from_original(tensors, config: dict, file: Path) -> MedusaHeads:
    heads, _ = _collect(tensors, file)
    num_heads = config.get("medusa_num_heads")
    num_layers = config.get("medusa_num_layers")
    for key, value in (("medusa_num_heads", num_heads), ("medusa_num_layers", num_layers)):
        if value is not None and not (isinstance(value, int) and value > 0):
            raise ModelFormatError(f"config.json of {file}: {key} must be a positive integer")
    blocks, lm_heads = _assemble(heads, file, num_heads, num_layers, need_lm_heads=True)
    vocab_size = int(lm_heads[0].shape[0]) if lm_heads is not None else None
    info = {"base_model": config.get("base_model_name_or_path", ""), "source": "medusa"}
    return MedusaHeads(blocks, lm_heads, None, vocab_size, info)


# -- the shipped heads ---------------------------------------------------------

def shipped_heads_path(model_name: str) -> Path | None:
    """The heads forerun ships for a preset, if any."""
    path = Path(__file__).resolve().parents[2] / "data" / "medusa" / f"{model_name}.safetensors"
    return path if path.is_file() else None


# -- the drafter ---------------------------------------------------------------

class MedusaDrafter:
    """Turns Medusa heads into ranked candidates for a draft tree.

    Depth ``d`` of the tree (the root is the last committed token) is head
    ``d - 1``'s guess; its rank-``r`` node is that head's ``r``-th most likely
    token.  Candidates are deterministic (top-k), so the tree acceptance rule
    treats each as a point mass, which keeps sampling lossless.
    """

    name = "medusa"
    needs_hidden = True

    def __init__(self, heads: MedusaHeads, base_lm_head: torch.Tensor | None,
                 *, max_width: int = 8, rows_selected: bool = False) -> None:
        self.heads = heads
        if heads.lm_heads is None and base_lm_head is None:
            raise ConfigError("these Medusa heads share the base model's LM head: pass it")
        if (heads.vocab is not None and heads.lm_heads is None and base_lm_head is not None
                and not rows_selected):
            # Keep only the rows of the candidate vocabulary (a copy of V' rows).
            self._lm_rows: torch.Tensor | None = base_lm_head.index_select(
                0, heads.vocab.to(base_lm_head.device))
        else:
            self._lm_rows = base_lm_head
        self.max_depth = heads.num_heads
        self.max_width = max_width
        self._seconds: dict[int, float] = {}

    @classmethod
    def for_decoder(cls, heads: MedusaHeads, decoder, name: str = "the model",
                    **kwargs) -> MedusaDrafter:
        """A drafter for a decoder with hidden states and an output layer
        (``capabilities.output_layer``): checks the heads against the model
        and moves them to its device and dtype."""
        layer = decoder.output_layer
        heads.check_base(layer.hidden_size, layer.vocab_size, name)
        base = str(heads.info.get("base_model") or "")
        if base and name != "the model" and base != name and heads.info.get("source") != "medusa":
            warnings.warn(f"these Medusa heads were trained for {base}, not {name}; they fit "
                          f"its shape but may draft poorly (the output is unaffected)",
                          stacklevel=2)
        heads = heads.to(layer.device, layer.dtype)
        if heads.lm_heads is not None:
            return cls(heads, None, **kwargs)
        # Only the candidate vocabulary's rows of the LM head, as float.
        rows = layer.weight_rows(heads.vocab).to(layer.dtype)
        return cls(heads, rows, rows_selected=heads.vocab is not None, **kwargs)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        pass

    def rank_accuracy(self) -> list[list[float]] | None:
        return self.heads.rank_accuracy()

    @torch.inference_mode()
    def candidates(self, sequence: Sequence[int], hidden: torch.Tensor | None, depth: int,
                   width: int, sampler: TokenSampler) -> list[list[int]]:
        """The ``width`` most likely tokens of heads ``0 .. depth-1`` from the
        hidden state of the token before the last committed one."""
        if hidden is None or depth <= 0 or width <= 0:
            return []
        start = time.perf_counter()
        depth = min(depth, self.max_depth)
        heads = self.heads
        states = heads.head_states(hidden.reshape(-1).to(heads.dtype), depth)
        if heads.lm_heads is not None:
            logits = torch.stack([F.linear(s, m) for s, m in zip(states, heads.lm_heads)])
        else:
            assert self._lm_rows is not None   # heads without LM heads: __init__ checked
            logits = F.linear(states, self._lm_rows)
        width = min(width, logits.shape[-1])
        top = torch.topk(logits, width, dim=-1).indices
        if heads.vocab is not None:
            top = heads.vocab[top]
        out = top.tolist()
        elapsed = time.perf_counter() - start
        self._seconds[depth] = refine_seconds(self._seconds.get(depth), elapsed)
        return out

    def settle(self, length: int) -> None:
        pass

    def step_seconds(self, depth: int) -> float:
        """Measured seconds to draft a tree of this depth (0 before the
        first measurement)."""
        if depth <= 0:
            return 0.0
        if depth in self._seconds:
            return self._seconds[depth]
        known = sorted(self._seconds.items())
        if not known:
            return 0.0
        d, s = min(known, key=lambda x: abs(x[0] - depth))
        return s * depth / d


def build(target: MethodTarget, options: MethodOptions) -> TreeSpeculativeDecoding:
    """Medusa's method (the registry's ``medusa``): heads drafting a rank
    tree of ``options.tree_nodes`` nodes (default: chosen by the heads'
    measured accuracies)."""
    drafter = medusa_drafter(target, options.draft)
    target.verification_grouping()
    return TreeSpeculativeDecoding(target.decoder, drafter, nodes=options.tree_nodes,
                                   cost_store=target.cost_store("+tree"))


def medusa_drafter(model: MethodTarget, draft) -> MedusaDrafter:
    """The tree drafter for ``draft`` on ``model`` (a target):
    ``"medusa"`` takes the heads forerun ships for the model (a preset),
    ``"medusa:PATH"`` reads heads from a file or folder (either format)."""
    if hasattr(draft, "candidates"):
        return draft
    decoder = model.decoder   # (its row needs hidden_states and output_layer)
    if isinstance(draft, MedusaHeads):
        heads = draft
    else:
        heads = MedusaHeads.load(heads_file(
            draft, "medusa", "Medusa heads", shipped_heads_path(model.name), model.name,
            f"forerun train medusa --model {model.name} --corpus PATH --out FILE"))
    return MedusaDrafter.for_decoder(heads, decoder, model.name)
