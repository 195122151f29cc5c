"""The target (a Qwen2 or Llama GGUF, dequantized) as plain torch tensors on
one device, with a KV cache of fixed slots: what ``make_corpus.py`` runs
many sequences on at once on a GPU machine.

Not forerun's engine (that one is made for a CPU's cores and keeps one
sequence's cache); this is the textbook forward written for large batches:

* :meth:`Target.prefill` reads the prompts of some slots (right-padded into
  one matrix, causal attention among each prompt's own tokens) and writes
  their keys and values at positions ``0 ..`` of those slots;
* :meth:`Target.decode` feeds one token to every slot at its own position
  (slots without a sequence compute and are ignored): attention reads each
  slot's cache up to its position, grouped-query heads without copies;
* :meth:`Target.features` runs records without a cache and returns what an
  EAGLE-3 head learns from: the residual stream entering three layers, and
  the target's top-k next-token log-probabilities (forerun's
  ``eagle_features`` computes the same on the CPU engine).

The weights come from :class:`forerun.loading.gguf_file.GGUFFile` (float32,
Hugging Face names), cast to ``dtype``.  ``tests/real`` checks the greedy
tokens against forerun's own float32 engine on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from forerun.loading.gguf_file import GGUFFile


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: the mean square in float32, the weight in ``x``'s dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, Hugging Face's half-split form (``x``: ``[N, heads, hd]``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Target:
    """The model's weights on ``device`` and a cache of ``slots`` sequences
    of at most ``max_len`` tokens (``slots`` 0: no cache, features only)."""

    def __init__(self, path: str, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 slots: int = 0, max_len: int = 2048) -> None:
        gguf = GGUFFile(path)
        c = gguf.config()
        if c.rope_scaling:
            raise ValueError("rope scaling is not implemented here")
        self.config = c
        self.device = torch.device(device)
        self.dtype = dtype
        w: dict[str, torch.Tensor] = {}
        for name, array in gguf.weights(c):
            w[name] = torch.from_numpy(array).to(self.device, dtype)
        self.embed = w.pop("model.embed_tokens.weight")
        self.lm_head = w.pop("lm_head.weight", self.embed)
        self.norm = w.pop("model.norm.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."

            def get(name: str, rows: int, p: str = p) -> torch.Tensor:
                t = w.pop(p + name, None)
                return torch.zeros(rows, device=self.device, dtype=dtype) if t is None else t

            q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            self.layers.append({
                "ln1": w.pop(p + "input_layernorm.weight"),
                "qkv": torch.cat([w.pop(p + "self_attn.q_proj.weight"),
                                  w.pop(p + "self_attn.k_proj.weight"),
                                  w.pop(p + "self_attn.v_proj.weight")]),
                "qkv_bias": torch.cat([get("self_attn.q_proj.bias", q_rows),
                                       get("self_attn.k_proj.bias", kv_rows),
                                       get("self_attn.v_proj.bias", kv_rows)]),
                "o": w.pop(p + "self_attn.o_proj.weight"),
                "ln2": w.pop(p + "post_attention_layernorm.weight"),
                "gate_up": torch.cat([w.pop(p + "mlp.gate_proj.weight"),
                                      w.pop(p + "mlp.up_proj.weight")]),
                "down": w.pop(p + "mlp.down_proj.weight"),
            })
        if w:
            raise ValueError(f"weights left unused: {sorted(w)[:5]}")
        hd = c.head_dim
        self.inv_freq = 1.0 / (c.rope_theta ** (
            torch.arange(0, hd, 2, device=self.device, dtype=torch.float32) / hd))
        self.slots, self.max_len = slots, max_len
        shape = (c.num_layers, slots, c.num_kv_heads, max_len, hd)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=dtype) if slots else None
        self.v_cache = torch.zeros(shape, device=self.device, dtype=dtype) if slots else None

    # -- pieces ------------------------------------------------------------------
    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _layers(self, x: torch.Tensor, positions: torch.Tensor,
                attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                capture: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every layer over the flat tokens ``x`` (``[N, H]``); ``attend(i,
        q, k, v)`` gives layer ``i``'s attention output ``[N, heads * hd]``.
        Returns the last layer's output and the inputs of the ``capture``
        layers (``num_layers``: the last output)."""
        c = self.config
        cos, sin = self._cos_sin(positions)
        n = x.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        states: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                states[i] = x
            h = rms_norm(x, layer["ln1"], c.rms_norm_eps)
            qkv = F.linear(h, layer["qkv"], layer["qkv_bias"])
            q = qkv[:, :q_size].view(n, c.num_heads, c.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(n, c.num_kv_heads, c.head_dim)
            v = qkv[:, q_size + kv_size:].view(n, c.num_kv_heads, c.head_dim)
            a = attend(i, rotate(q, cos, sin), rotate(k, cos, sin), v)
            x = x + F.linear(a, layer["o"])
            h = rms_norm(x, layer["ln2"], c.rms_norm_eps)
            gate, up = F.linear(h, layer["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        if c.num_layers in capture:
            states[c.num_layers] = x
        return x, [states[i] for i in capture]

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """Float32 logits of last-layer outputs ``[R, H]``."""
        return F.linear(rms_norm(last, self.norm, self.config.rms_norm_eps),
                        self.lm_head).float()

    def _causal(self, rows: int, width: int) -> Callable:
        """Attention among the ``width`` right-padded tokens of ``rows`` sequences."""
        c = self.config
        groups = c.num_heads // c.num_kv_heads

        def attend(_i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q = q.view(rows, width, c.num_heads, c.head_dim).transpose(1, 2)
            k = k.view(rows, width, c.num_kv_heads, c.head_dim).transpose(1, 2)
            v = v.view(rows, width, c.num_kv_heads, c.head_dim).transpose(1, 2)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.transpose(1, 2).reshape(rows * width, c.num_heads * c.head_dim)

        return attend

    @staticmethod
    def _padded(prompts: Sequence[Sequence[int]], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, :len(p)] = torch.tensor(list(p), dtype=torch.long)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        return ids.to(device), lengths.to(device), width

    # -- the three uses -----------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Read ``prompts`` into ``slots`` (from position 0); the float32
        logits of each prompt's last token ``[len(slots), vocab]``."""
        assert self.k_cache is not None and self.v_cache is not None
        ids, lengths, width = self._padded(prompts, self.device)
        if width > self.max_len:
            raise ValueError(f"a prompt of {width} tokens does not fit {self.max_len}")
        rows = len(prompts)
        index = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        causal = self._causal(rows, width)
        k_cache, v_cache = self.k_cache, self.v_cache
        c = self.config

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kk = k.view(rows, width, c.num_kv_heads, c.head_dim).transpose(1, 2)
            vv = v.view(rows, width, c.num_kv_heads, c.head_dim).transpose(1, 2)
            k_cache[i, index, :, :width] = kk
            v_cache[i, index, :, :width] = vv
            return causal(i, q, k, v)

        positions = torch.arange(width, device=self.device).repeat(rows)
        x = self.embed[ids.reshape(-1)]
        out, _ = self._layers(x, positions, attend)
        last = out.view(rows, width, -1)[torch.arange(rows, device=self.device), lengths - 1]
        return self.logits(last)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """Feed ``tokens[s]`` to every slot ``s`` at ``positions[s]`` (``[slots]``
        each, on the device); attention reads positions ``0 .. positions[s]``
        of the first ``length`` cache positions.  Float32 logits ``[slots, vocab]``."""
        assert self.k_cache is not None and self.v_cache is not None
        c = self.config
        b = self.slots
        groups = c.num_heads // c.num_kv_heads
        rows = torch.arange(b, device=self.device)
        masked = torch.arange(length, device=self.device)[None, :] > positions[:, None]
        mask = torch.zeros(b, length, device=self.device, dtype=torch.float32)
        mask = mask.masked_fill(masked, float("-inf"))[:, None, None, :]
        scale = 1.0 / math.sqrt(c.head_dim)
        k_cache, v_cache = self.k_cache, self.v_cache

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache[i, rows, :, positions] = k
            v_cache[i, rows, :, positions] = v
            kc, vc = k_cache[i, :, :, :length], v_cache[i, :, :, :length]
            qg = q.view(b, c.num_kv_heads, groups, c.head_dim)
            scores = torch.matmul(qg, kc.transpose(-1, -2)).float() * scale + mask
            probs = torch.softmax(scores, dim=-1).to(self.dtype)
            return torch.matmul(probs, vc).reshape(b, c.num_heads * c.head_dim)

        out, _ = self._layers(self.embed[tokens], positions, attend)
        return self.logits(out)

    @torch.no_grad()      # (not inference mode: the head's training reads them)
    def features(self, records: Sequence[Sequence[int]], aux_layers: Sequence[int], top_k: int,
                 logit_rows: int = 8192) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per record: the states entering ``aux_layers`` (``[T, 3H]`` in the
        model's dtype), and the target's top-``top_k`` ids (int64) and
        log-probabilities (float32) of each position's next token."""
        ids, lengths, width = self._padded(records, self.device)
        rows = len(records)
        positions = torch.arange(width, device=self.device).repeat(rows)
        capture = (*aux_layers, self.config.num_layers)
        _, states = self._layers(self.embed[ids.reshape(-1)], positions,
                                 self._causal(rows, width), capture)
        aux = torch.cat(states[:3], dim=-1).view(rows, width, -1)
        last = states[3]
        top_ids, top_logp = [], []
        for a in range(0, last.shape[0], logit_rows):
            logp = torch.log_softmax(self.logits(last[a:a + logit_rows]), dim=-1)
            top = torch.topk(logp, top_k, dim=-1)
            top_ids.append(top.indices)
            top_logp.append(top.values)
        ti = torch.cat(top_ids).view(rows, width, top_k)
        tl = torch.cat(top_logp).view(rows, width, top_k)
        return [(aux[r, :n].clone(), ti[r, :n].clone(), tl[r, :n].clone())
                for r, n in enumerate(lengths.tolist())]
