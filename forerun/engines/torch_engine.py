"""forerun's PyTorch engine: a :class:`~forerun.protocol.decoder.Decoder` over
:class:`~forerun.engines.transformer.Transformer` and a preallocated
:class:`~forerun.protocol.kv_cache.KVCache`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from forerun.engines.base import EngineDecoder
from forerun.engines.kernel_choice import product_kernels
from forerun.engines.linear import Linear
from forerun.engines.prefill_kernel import GEMM_ROWS
from forerun.engines.transformer import Transformer
from forerun.errors import (
    CacheStateError,
    ConfigError,
    ContextLengthError,
    InvalidTokenError,
    UnsupportedOperationError,
)
from forerun.protocol.decoder import Capabilities, EngineSettings, ForwardOutput
from forerun.protocol.kv_cache import KVCache
from forerun.protocol.prefix_reuse import PrefixPayload

# Positions per prefill block (see forerun.protocol.prefix_reuse): large enough that a
# block runs the matrix kernels at full speed, small enough that a chat turn
# reuses most of the previous prompt.
PREFILL_BLOCK = 128

# Where forerun's native layer operations run (Transformer.layer_ops), every
# ``last_only`` feed (a prompt's blocks, a draft model's catch-up on a
# round's committed tokens) runs its positions as one-position forwards do,
# in one native call per layer (Transformer.forward's ``rowwise``), not
# through torch's operators.  On the native matrix kernels, whose products
# don't depend on the rows fed, a prompt's cache and logits are then those
# of feeding its tokens one by one, to the bit.
# On an AMD EPYC Zen 3 (AVX2, 2 threads; prompts of 128, 512 and 1,536
# tokens, the two ways alternated in one process, two runs) prompts were
# read 1.18 to 1.26 times as fast for Gemma 3 270M, 1.03 to 1.13 for the
# 1.5B at 128 and 512 tokens, 1.01 to 1.65 for the 0.5B and SmolLM2-135M
# there; at 1,536 tokens 0.92 to 1.05 (torch's attention is faster than the
# native one at long contexts, its other operators slower).


def _check_threads(n) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"a thread count must be a positive integer, got {n!r}")


class TorchDecoder(EngineDecoder):
    """Implements the Decoder protocol; see :mod:`forerun.protocol.decoder` for the
    contract of each method."""

    engine = "torch"
    capabilities = Capabilities(hidden_states=True, tree_masks=True, slot_compaction=True,
                                output_layer=True, fork=True, output_vocabulary=True,
                                layer_states=True, batch=True)
    # A verification attends for each position on its own, through the very
    # call a one-position forward makes (Transformer.forward's ``rowwise``),
    # so a group differs from one-by-one forwards only in its matrix
    # products, whose kernels depend on the rows, not on the context.  The
    # probe's long context need only pass the size from which a prompt block
    # may take another product (prefill_kernel.GEMM_ROWS); 1,200, what
    # llama.cpp needs, took 30 s of a q8 1.5B's first run on an AMD EPYC.
    probe_context = GEMM_ROWS + 32

    @property
    def group_ceiling(self) -> int | None:
        """None on the CPU, where each kernel's rounding of a row is fixed
        by the shapes it runs at, so the probe's tokens show any difference.
        On other devices the network's padded rows
        (:data:`~forerun.engines.transformer.PADDED_ROWS`): every forward of
        up to that many positions runs its row-wise operations at that many
        rows, so each row is computed as a one-position forward computes it.
        Unpadded, on an NVIDIA H200 (torch 2.11, CUDA 13), groups of 2 to 16
        positions in bfloat16 differed from one-position forwards on 1 to 10
        of 28 token windows after the probe had found every group exact on
        its own tokens (``benchmarks/row_invariance.py``); float32 differed
        always.  A device where a group still differs is caught by the
        probe, which measures up to this ceiling."""
        return self.model.padded_rows

    def __init__(self, model: Transformer, context_length: int,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.model = model
        self.cache: KVCache = model.new_cache(context_length)
        self._positions = self.cache
        self._eos = tuple(int(e) for e in eos_token_ids)
        self.verify_group: int | None = None
        # (ids, layer): logits of those token ids only (restrict_output)
        self._head: tuple[torch.Tensor, Linear] | None = None
        #: where another thread runs this decoder's forwards (a batch's
        #: engine thread): that thread's count, asked for when needed
        self.forward_threads: Callable[[], int] | None = None

    def fork(self) -> TorchDecoder:
        """A second decoder over the same weights with its own, empty cache
        (a model drafting for itself, or a second conversation)."""
        fork = TorchDecoder(self.model, self.context_length, self._eos)
        fork.verify_group = self.verify_group
        return fork

    def restrict_output(self, ids: torch.Tensor | None) -> None:
        """From now on compute logits for the token ids ``ids`` only (int64,
        sorted and distinct; a head of those rows: a draft with a cut
        vocabulary), every other id's logit being ``-inf``; ``None``: the
        whole vocabulary again."""
        if ids is None:
            self._head = None
            return
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(self.device)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ConfigError(f"an output vocabulary must be ids in 0..{self.vocab_size - 1}")
        self._head = (ids, self.model.head_rows(ids))

    # -- facts -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def settings(self) -> EngineSettings:
        """Everything that decides which kernels run (and so the numerics
        and the costs): the engine, device, activation dtype, weight format,
        matrix kernels (forerun's native ones or torch's; for native ones,
        the instruction their products sum with), prefill kernel, thread
        count and torch's version."""
        kernels = self.model.matrix_kernels
        # Native layers exist only where product_kernels() is not None (it is
        # decided once and kept).
        native = product_kernels() if kernels == "native" else None
        return EngineSettings(
            engine=self.engine, device=str(self.device), threads=self.threads,
            weights=self.model.weights_format, kernels=kernels,
            instruction=None if native is None else native.instruction,
            dtype=str(self.model.dtype).removeprefix("torch."),
            prefill=self.model.prefill_kernel,
            extra=(("torch", torch.__version__),
                   ("kv cache", str(self.cache.keys.dtype).removeprefix("torch."))))

    @property
    def output_layer(self) -> _OutputLayer:
        """The network's LM head (:class:`~forerun.protocol.decoder.OutputLayer`)."""
        return _OutputLayer(self.model)

    @property
    def threads(self) -> int:
        """The thread count this decoder's forwards run on: the calling
        thread's torch intra-op count, or, for a batch member's decoder
        (:attr:`forward_threads` set), the batch's, whose engine thread runs
        its forwards."""
        return torch.get_num_threads() if self.forward_threads is None else self.forward_threads()

    def set_threads(self, n: int) -> None:
        """``torch.set_num_threads(n)`` for the calling thread.  Under
        OpenMP (torch's CPU backend) the count is per OS thread: another
        thread keeps its own.  torch also makes ``n`` the count that threads
        which have not run a parallel operation yet start with, so a caller
        that sets it temporarily sets it back when done."""
        _check_threads(n)
        torch.set_num_threads(n)

    # -- forward -----------------------------------------------------------
    def _tokens(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        if ids.numel() == 0:
            raise CacheStateError("feed() needs at least one token")
        vocab = self.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise InvalidTokenError(
                f"token ids must lie in 0..{vocab - 1}, got {ids.tolist()[:8]}...")
        if self.length + ids.numel() > self.context_length:
            raise ContextLengthError(
                f"{ids.numel()} tokens do not fit: the context holds "
                f"{self.length} of {self.context_length} positions. Use a shorter input "
                f"or load the model with a larger context_length.")
        return ids

    @property
    def num_layers(self) -> int:
        """The network's layer count (``hidden_layers`` names 0 to it)."""
        return self.model.config.num_layers

    @property
    def hidden_size(self) -> int:
        """The width of the residual stream a layer state has."""
        return self.model.config.hidden_size

    def embed_tokens(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The network's input embeddings of ``tokens``: float ``[T, hidden]``."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        return self.model.embed(ids).to(self.model.dtype)

    def _capture(self, hidden_layers: Sequence[int]) -> tuple[int, ...]:
        layers = tuple(int(n) for n in hidden_layers)
        top = self.model.config.num_layers
        if any(not 0 <= n <= top for n in layers):
            raise ConfigError(f"hidden_layers must be layer indices in 0..{top}, got "
                              f"{list(hidden_layers)}")
        return layers

    def feed(self, tokens: Sequence[int] | torch.Tensor, *, last_only: bool = False,
             return_hidden: bool = False, hidden_layers: Sequence[int] = ()
             ) -> ForwardOutput:
        ids = self._tokens(tokens)
        capture = self._capture(hidden_layers)
        start = self.length
        positions = torch.arange(start, start + ids.numel(), device=self.device)
        if last_only:
            per_position = self.model.layer_ops is not None
            states: list[torch.Tensor] = []
            logits, hidden = self.model.forward(ids, positions, self.cache, None,
                                                logits_rows=slice(-1, None),
                                                rowwise=per_position, head=self._head,
                                                states=states, capture=capture)
            out = ForwardOutput(logits, hidden if return_hidden else None,
                                torch.cat(states, dim=-1) if capture else None)
        else:
            out = self._in_groups(ids, positions, None, return_hidden, capture)
        self._record(ids.tolist())
        return out

    def _in_groups(self, ids: torch.Tensor, positions: torch.Tensor,
                   mask: torch.Tensor | None, return_hidden: bool,
                   capture: tuple[int, ...] = ()) -> ForwardOutput:
        """Forwards of at most :attr:`verify_group` positions: logits that do
        not depend on how a caller groups its positions into feeds."""
        t = ids.numel()
        group = self.verify_group or t
        base = self.length
        logits_parts, hidden_parts, state_parts = [], [], []
        for a in range(0, t, group):
            b = min(t, a + group)
            part_mask = mask if mask is None or (a, b) == (0, t) else mask[a:b, :base + b]
            states: list[torch.Tensor] = []
            logits, hidden = self.model.forward(ids[a:b], positions[a:b], self.cache, part_mask,
                                                rowwise=True, head=self._head,
                                                states=states, capture=capture)
            logits_parts.append(logits)
            hidden_parts.append(hidden)
            if capture:
                state_parts.append(torch.cat(states, dim=-1))

        def joined(parts: list[torch.Tensor]) -> torch.Tensor:
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        return ForwardOutput(joined(logits_parts),
                             joined(hidden_parts) if return_hidden else None,
                             joined(state_parts) if capture else None)

    def feed_batch(self, feeds: Sequence[tuple[TorchDecoder, Sequence[int] | torch.Tensor]]
                   ) -> list[ForwardOutput]:
        """Feed several sequences (this decoder and its forks) in shared
        forwards; see ``batch`` in :class:`~forerun.protocol.decoder.Capabilities`.
        Every feed is checked before any runs: on an error nothing changes.
        Forwards hold at most :attr:`verify_group` positions in all (a
        sequence's tokens may straddle two of them, in order)."""
        decoders = [d for d, _ in feeds]
        for d in decoders:
            if not isinstance(d, TorchDecoder) or d.model is not self.model:
                raise ConfigError("feed_batch feeds only this decoder and its forks (decoders "
                                  "over the same loaded weights)")
            if d._head is not None:
                raise UnsupportedOperationError("a decoder with a restricted output vocabulary "
                                                "can't share a batch's forward; feed it alone")
        if len({id(d) for d in decoders}) != len(decoders):
            raise CacheStateError("feed_batch got one decoder twice: feed its tokens together")
        ids = [d._tokens(tokens) for d, tokens in feeds]
        total = sum(i.numel() for i in ids)
        group = self.verify_group or total
        # Forwards of at most ``group`` rows, filled in feed order:
        # (decoder index, first token, last token + 1) per part.
        forwards: list[list[tuple[int, int, int]]] = [[]]
        room = group
        for n, seq in enumerate(ids):
            a = 0
            while a < seq.numel():
                if room == 0:
                    forwards.append([])
                    room = group
                b = min(seq.numel(), a + room)
                forwards[-1].append((n, a, b))
                room -= b - a
                a = b
        logits: list[list[torch.Tensor]] = [[] for _ in feeds]
        for parts in forwards:
            tokens = torch.cat([ids[n][a:b] for n, a, b in parts])
            positions = torch.cat([torch.arange(decoders[n].length, decoders[n].length + b - a,
                                                device=self.device) for n, a, b in parts])
            out, _ = self.model.forward_batch(tokens, positions,
                                              [(decoders[n].cache, b - a) for n, a, b in parts])
            row = 0
            for n, a, b in parts:
                logits[n].append(out[row:row + b - a])
                decoders[n]._record(ids[n][a:b].tolist())
                row += b - a
        return [ForwardOutput(rows[0] if len(rows) == 1 else torch.cat(rows))
                for rows in logits]

    def forward(self, tokens: Sequence[int] | torch.Tensor,
                positions: Sequence[int] | torch.Tensor, attention_mask: torch.Tensor,
                *, return_hidden: bool = False, hidden_layers: Sequence[int] = ()
                ) -> ForwardOutput:
        ids = self._tokens(tokens)
        capture = self._capture(hidden_layers)
        t = ids.numel()
        pos = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(-1)
        if pos.numel() != t:
            raise CacheStateError(f"{t} tokens need {t} positions, got {pos.numel()}")
        mask = torch.as_tensor(attention_mask, device=self.device)
        if mask.dtype != torch.bool or tuple(mask.shape) != (t, self.length + t):
            raise CacheStateError(
                f"attention_mask must be bool of shape {(t, self.length + t)}, got "
                f"{mask.dtype} {tuple(mask.shape)}")
        if not bool(mask.any(dim=1).all()):
            raise CacheStateError("every row of attention_mask must allow at least one slot")
        return self._in_groups(ids, pos, mask, return_hidden, capture)

    # -- cache control -----------------------------------------------------
    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def reset(self) -> None:
        self.cache.reset()

    def keep_slots(self, slots: Sequence[int] | torch.Tensor, start: int) -> None:
        """Move cache ``slots`` to contiguous slots from ``start`` and drop the
        rest (tree verification keeps its accepted path with this)."""
        self.cache.move(torch.as_tensor(slots, dtype=torch.long), start)

    # -- exact prefix reuse: forerun.protocol.prefix_reuse.PrefixReuse ----------------
    prefill_block = PREFILL_BLOCK

    @property
    def exact_positions(self) -> bool:
        # The network's (Transformer.exact_positions), fixed at load: the
        # native layer operations and native products for every layer.
        if self._exact is None:
            self._exact = self.model.exact_positions
        return self._exact

    _exact: bool | None = None

    def keep_prefix(self, length: int) -> None:
        self.cache.keep_prefix(length)

    def _prefix_owner(self) -> tuple:
        # Whatever decides the numerics of the saved keys and values.  Where
        # positions are exact, not the thread count: the native kernels
        # compute every output of a row on one thread, in one order,
        # whatever the count (a server that follows the machine's load
        # changes it between requests, and keeps its cache).
        threads = None if self.exact_positions else self.threads
        return (self.model, self.context_length, self.prefill_block, threads)

    def export_prefix(self):
        tokens = self.prefilled_tokens
        self.cache.keep_prefix(len(tokens))
        data = self.cache.export()
        nbytes = 2 * data["keys"].numel() * data["keys"].element_size()
        return PrefixPayload(tokens, data, nbytes, self._prefix_owner())

    def restore_prefix(self, payload) -> None:
        if payload.owner != self._prefix_owner():
            raise CacheStateError("this saved prefix belongs to another model or engine "
                                  "setting; it can't be restored here")
        self.cache.restore(payload.data)
        self.cache.set_prefilled(payload.tokens)
        self._ledger_owner = payload.owner


class _OutputLayer:
    """A :class:`~forerun.protocol.decoder.OutputLayer` over a network's LM head."""

    def __init__(self, network: Transformer) -> None:
        self._head = network.lm_head
        self.hidden_size = network.config.hidden_size
        self.vocab_size = network.config.vocab_size
        self.dtype = network.dtype
        self.device = network.device

    def weight_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        return self._head.weight_rows(ids)
