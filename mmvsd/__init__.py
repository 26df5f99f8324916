"""mmvsd: multimodal speculative decoding with Variational Speculative Decoding drafters.

Glossary (used in docstrings and names across the package):
    target      the model whose output must not change (an HF causal LM or LLaVA model).
    drafter     the small model that proposes draft tokens (EAGLE-3, MSD, ViSpec, ...).
    root        the last committed token of a sequence; its KV is not yet in the target cache.
                It is node 0 of every draft tree and is always "accepted".
    draft tokens  the non-root nodes of a draft tree.
    accepted    draft tokens the target agrees with (T=0) or keeps after rejection sampling (T>0).
    bonus       the one token the target itself samples after the last accepted node; it becomes
                the next root. Each target forward therefore yields accepted + 1 tokens.
    tau         mean tokens per target forward, bonus included (EAGLE's convention); the prefill
                forward counts as one forward yielding one token, so vanilla decoding has tau = 1.

Shape letters in comments:
    B batch, T cached sequence length, N tree nodes (root included), D tree depth,
    K frontier width (top-k), A accepted path length (root included), V target vocab,
    Vd draft vocab, H hidden size, L layers.
"""

__version__ = "0.1.0"
