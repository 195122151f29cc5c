"""Can llama.cpp verify a token tree exactly?  A tree verified in one
``llama_decode`` through sequence-id sets (a sequence per leaf; a node's cell
belongs to the sequences of the leaves below it, so a node attends to its
ancestors and the prompt only), against plain one-by-one decoding of each
root-to-leaf path; then the cache compacted to one accepted path
(``seq_keep`` of that leaf's sequence, copied back to sequence 0) and the
next position compared with plain decoding's.  Prints the largest logit
difference per node, after compaction, and the time of the tree forward
against a chain forward of the same size.

    python benchmarks/experiments/llama_cpp_tree_probe.py [GGUF] [--tree -1,0,0]

``GGUF`` defaults to the 0.5B preset's; ``--tree`` gives each node's parent
(-1: the root), by default ``-1,0,0,0,1,1,2,4`` (or the ``TREE`` variable).

It uses llama-cpp-python's low-level API directly (forerun's llama.cpp
engine does not take tree masks), with forerun's cache settings (flash
attention, F16 keys, Q8_0 values) on 2 threads.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

N_SEQ = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", nargs="?", type=Path, help="a GGUF file (default: the 0.5B preset)")
    ap.add_argument("--tree", default=os.environ.get("TREE", "-1,0,0,0,1,1,2,4"),
                    help="the parent of each node, -1 for the root")
    args = ap.parse_args()

    import llama_cpp as lc
    import numpy as np

    if args.gguf is not None:
        path = args.gguf
    else:
        from forerun.loading.load import load_model_files
        path = load_model_files("qwen2.5-coder-0.5b").gguf_path
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))

    def context(n_seq):
        p = lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max, p.kv_unified = 1024, 64, 64, n_seq, True
        p.n_threads = p.n_threads_batch = 2
        p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        p.type_k, p.type_v, p.no_perf = lc.GGML_TYPE_F16, lc.GGML_TYPE_Q8_0, True
        return lc.llama_init_from_model(model, p)

    batch = lc.llama_batch_init(64, 0, N_SEQ)

    def decode(ctx, toks, poss, seqs):
        n = len(toks)
        for i, (t, p, s) in enumerate(zip(toks, poss, seqs)):
            batch.token[i], batch.pos[i], batch.logits[i] = t, p, 1
            batch.n_seq_id[i] = len(s)
            for j, q in enumerate(s):
                batch.seq_id[i][j] = q
        batch.n_tokens = n
        rc = lc.llama_decode(ctx, batch)
        assert rc == 0, rc
        return np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(n, vocab)).copy()

    prompt = list(range(1000, 1040))
    base = len(prompt)
    # A tree: node -> parent (-1: the root, at position base)
    parents = [int(p) for p in args.tree.strip("[]").split(",")]
    tokens = [2000 + 7 * i for i in range(len(parents))]
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    children = {i: [j for j, q in enumerate(parents) if q == i] for i in range(len(parents))}
    leaves = [i for i in range(len(parents)) if not children[i]]
    leaf_seq = {leaf: s for s, leaf in enumerate(leaves)}

    def subtree_leaves(i):
        return [i] if not children[i] else [x for c in children[i] for x in subtree_leaves(c)]

    def path_to(leaf):
        path = []
        i = leaf
        while i >= 0:
            path.append(i)
            i = parents[i]
        return path[::-1]

    seqs = [sorted(leaf_seq[x] for x in subtree_leaves(i)) for i in range(len(parents))]

    ctx = context(N_SEQ)
    mem = lc.llama_get_memory(ctx)
    # plain reference: each path fed one token at a time
    ref = {}
    decode(ctx, prompt, list(range(base)), [[0]] * base)
    for leaf in leaves:
        for i in path_to(leaf):
            lg = decode(ctx, [tokens[i]], [base + depth[i]], [[0]])[0]
            ref.setdefault(i, lg)
        lc.llama_memory_seq_rm(mem, 0, base, -1)
    # the tree, in one decode
    for s in range(1, len(leaves)):
        lc.llama_memory_seq_cp(mem, 0, s, -1, -1)
    t0 = time.perf_counter()
    tree = decode(ctx, tokens, [base + d for d in depth], seqs)
    t_tree = time.perf_counter() - t0
    for i in range(len(parents)):
        diff = float(np.abs(tree[i] - ref[i]).max())
        print(f"node {i} depth {depth[i]} seqs {seqs[i]}: max |tree - plain| = {diff:.3g}, "
              f"same argmax {tree[i].argmax() == ref[i].argmax()}")
    # compaction: keep the path to the last leaf (0, 1, 4, 7 by default), as sequence 0
    s = leaf_seq[leaves[-1]]
    kept = path_to(leaves[-1])
    lc.llama_memory_seq_keep(mem, s)
    if s != 0:
        lc.llama_memory_seq_cp(mem, s, 0, -1, -1)
        lc.llama_memory_seq_rm(mem, s, -1, -1)
    after = decode(ctx, [3000], [base + len(kept)], [[0]])[0]
    lc.llama_memory_seq_rm(mem, 0, base, -1)
    for i in kept:
        decode(ctx, [tokens[i]], [base + depth[i]], [[0]])
    plain = decode(ctx, [3000], [base + len(kept)], [[0]])[0]
    print(f"after compaction, the next position: max diff {float(np.abs(after - plain).max()):.3g}")
    # timing against a chain of the same size
    lc.llama_memory_seq_rm(mem, 0, base, -1)
    t0 = time.perf_counter()
    decode(ctx, tokens, [base + i for i in range(len(tokens))], [[0]] * len(tokens))
    t_chain = time.perf_counter() - t0
    print(f"one forward of {len(tokens)} positions: tree {t_tree*1000:.1f} ms, "
          f"chain {t_chain*1000:.1f} ms")


if __name__ == "__main__":
    main()
