"""The largest drafts the decoding methods verify: chains of at most
:data:`MAX_DRAFT_LENGTH` tokens, trees of at most :data:`MAX_TREE_NODES`
nodes.  This module imports nothing, so that options can be checked against
them before anything loads."""

#: the longest chain a round drafts
MAX_DRAFT_LENGTH = 16

#: the most nodes of a drafted tree
MAX_TREE_NODES = 64
