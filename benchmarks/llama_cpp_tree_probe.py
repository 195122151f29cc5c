"""Can llama.cpp verify a token tree exactly?  A tree verified in one
``llama_decode`` through sequence-id sets (a sequence per leaf; a node's cell
belongs to the sequences of the leaves below it, so a node attends to its
ancestors and the prompt only), against plain one-by-one decoding of each
root-to-leaf path; then the cache compacted to one accepted path
(``seq_keep`` of that leaf's sequence, copied back to sequence 0) and the
next position compared with plain decoding's.  Prints the largest logit
difference per node, after compaction, and the time of the tree forward
against a chain forward of the same size.

    python benchmarks/llama_cpp_tree_probe.py [GGUF]      (default: the 0.5B preset)
    TREE="-1,0,0" python benchmarks/llama_cpp_tree_probe.py   (parent of each node)

It uses llama-cpp-python's low-level API directly (forerun's llama.cpp
engine does not take tree masks), with forerun's cache settings (flash
attention, F16 keys, Q8_0 values) on 2 threads.
"""
import os
import sys
import time
from pathlib import Path

import llama_cpp as lc
import numpy as np

from forerun.engines.llama_cpp_engine import _init_backend

if len(sys.argv) > 1:
    path = Path(sys.argv[1])
else:
    from forerun.loading.load import load_model_files
    path = load_model_files("qwen2.5-coder-0.5b").gguf_path
_init_backend(lc, False)
mp = lc.llama_model_default_params()
model = lc.llama_model_load_from_file(str(path).encode(), mp)
vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
N_SEQ = 8

def context(n_seq):
    p = lc.llama_context_default_params()
    p.n_ctx = 1024; p.n_batch = 64; p.n_ubatch = 64; p.n_seq_max = n_seq; p.kv_unified = True
    p.n_threads = 2; p.n_threads_batch = 2
    p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
    p.type_k = lc.GGML_TYPE_F16; p.type_v = lc.GGML_TYPE_Q8_0; p.no_perf = True
    return lc.llama_init_from_model(model, p)

batch = lc.llama_batch_init(64, 0, N_SEQ)

def decode(ctx, toks, poss, seqs):
    n = len(toks)
    for i, (t, p, s) in enumerate(zip(toks, poss, seqs)):
        batch.token[i] = t; batch.pos[i] = p; batch.logits[i] = 1
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
parents = [int(p) for p in os.environ.get("TREE", "-1,0,0,0,1,1,2,4").strip("[]").split(",")]
tokens = [2000 + 7 * i for i in range(len(parents))]
depth = []
for p in parents:
    depth.append(0 if p < 0 else depth[p] + 1)
children = {i: [j for j, q in enumerate(parents) if q == i] for i in range(len(parents))}
leaves = [i for i in range(len(parents)) if not children[i]]
leaf_seq = {leaf: s for s, leaf in enumerate(leaves)}

def subtree_leaves(i):
    return [i] if not children[i] else [l for c in children[i] for l in subtree_leaves(c)]

seqs = [sorted(leaf_seq[l] for l in subtree_leaves(i)) for i in range(len(parents))]

ctx = context(N_SEQ)
mem = lc.llama_get_memory(ctx)
# plain reference: each path fed one token at a time
ref = {}
decode(ctx, prompt, list(range(base)), [[0]] * base)
for leaf in leaves:
    path = []
    i = leaf
    while i >= 0:
        path.append(i); i = parents[i]
    path.reverse()
    for i in path:
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
    print(f"node {i} depth {depth[i]} seqs {seqs[i]}: max |tree - plain| = {diff:.3g}, same argmax {tree[i].argmax() == ref[i].argmax()}")
# compaction: keep the path to leaf 7 (0, 1, 4, 7), as sequence 0
s = leaf_seq[leaves[-1]]
PATH = []
i = leaves[-1]
while i >= 0:
    PATH.append(i); i = parents[i]
PATH.reverse()
lc.llama_memory_seq_keep(mem, s)
if s != 0:
    lc.llama_memory_seq_cp(mem, s, 0, -1, -1)
    lc.llama_memory_seq_rm(mem, s, -1, -1)
after = decode(ctx, [3000], [base + len(PATH)], [[0]])[0]
lc.llama_memory_seq_rm(mem, 0, base, -1)
plain = None
for i in PATH:
    decode(ctx, [tokens[i]], [base + depth[i]], [[0]])
plain = decode(ctx, [3000], [base + len(PATH)], [[0]])[0]
print(f"after compaction, the next position: max diff {float(np.abs(after - plain).max()):.3g}")
# timing against a chain of the same size
lc.llama_memory_seq_rm(mem, 0, base, -1)
t0 = time.perf_counter()
decode(ctx, tokens, [base + i for i in range(len(tokens))], [[0]] * len(tokens))
t_chain = time.perf_counter() - t0
print(f"one forward of {len(tokens)} positions: tree {t_tree*1000:.1f} ms, chain {t_chain*1000:.1f} ms")
