"""N-gram (prompt-lookup) drafting: proposals copied from the text seen so far, served as a tree expander.

Glossary:
- history: a row's committed tokens (prompt + generated), as the decode loop feeds them through
  `DraftSession.advance` (`DraftInputs.next_ids`); it always ends with the current tree root.
- match: an earlier position where the history's last n tokens occurred too (n from `max_n` down
  to `min_n`); its continuation is the `max_len` tokens that followed it (extrapolated periodically
  when it runs into the history's end, so a text that repeats itself is continued in full).
- trie: the distinct continuations of the latest matches (most recent longest match first), merged
  into a prefix tree whose root is the tree root; a node's rank is its place among its siblings.
- score: the log-probability that a proposal is accepted given its parent was, estimated online per
  (depth, rank) from this session's own past proposals against what the target committed (Beta
  prior). Scores are on the scale of a neural drafter's draft log-probs, so the tree builder and a
  hybrid can rank both together.

The proposer has no parameters and reads no target features; the verifier never learns who proposed
a branch, so output stays the target's own (greedy: token for token; sampling: in distribution).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from mmvsd.drafter_base import DraftInputs
from mmvsd.errors import UserError

NEG_INF = float("-inf")
PAD_ID = 0  # token id of an absent proposal (its score is -inf)
MAX_SCAN = 64  # earlier positions examined per n-gram length and lookup (bounds the cost on common tokens)


@dataclass(frozen=True)
class NgramConfig:
    """How the n-gram proposer looks up continuations and scores them."""

    max_n: int = 4  # longest suffix looked up
    min_n: int = 1  # shortest suffix looked up
    num_continuations: int = 4  # distinct continuations per lookup (the root's children at most)
    max_len: int = 8  # tokens per continuation (deepest proposal)
    prior_accept: float = 0.5  # Beta prior mean of a proposal's acceptance
    prior_weight: float = 2.0  # Beta prior strength, in pseudo-observations

    def __post_init__(self) -> None:
        problems = []
        if self.min_n < 1:
            problems.append(f"min_n must be >= 1, got {self.min_n}")
        if self.max_n < self.min_n:
            problems.append(f"max_n must be >= min_n ({self.min_n}), got {self.max_n}")
        if self.num_continuations < 1:
            problems.append(f"num_continuations must be >= 1, got {self.num_continuations}")
        if self.max_len < 1:
            problems.append(f"max_len must be >= 1, got {self.max_len}")
        if not 0.0 < self.prior_accept < 1.0:
            problems.append(f"prior_accept must be in (0, 1), got {self.prior_accept}")
        if not self.prior_weight > 0.0:
            problems.append(f"prior_weight must be > 0, got {self.prior_weight}")
        if problems:
            raise UserError("n-gram drafter: " + "; ".join(problems))


def parse_ngram_spec(spec: str) -> NgramConfig:
    """`ngram` or `ngram:key=value,...` (keys of `NgramConfig`) -> the config; UserError on anything else."""
    name, _, options = spec.partition(":")
    if name != "ngram":
        raise UserError(f"not an n-gram drafter spec: {spec!r}")
    types = {f.name: f.type for f in fields(NgramConfig)}
    values: dict[str, int | float] = {}
    for item in filter(None, options.split(",")):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or key not in types:
            raise UserError(f"--drafter {spec!r}: unknown n-gram option {item!r}; "
                            f"options: {', '.join(types)} (e.g. ngram:max_n=3,max_len=6)")
        try:
            values[key] = int(text) if types[key] == "int" else float(text)
        except ValueError:
            raise UserError(f"--drafter {spec!r}: {key} must be {'an integer' if types[key] == 'int' else 'a number'}"
                            f", got {text!r}") from None
    return NgramConfig(**values)


class NgramIndex:
    """One row's history and an index from each n-gram (n in [min_n, max_n]) to where it ends."""

    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        self.history: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> end positions, ascending

    def extend(self, token_ids: list[int]) -> None:
        """Append committed tokens and index the n-grams ending at each (incremental: no rescans)."""
        for token in token_ids:
            self.history.append(token)
            end = len(self.history) - 1
            for n in range(self.config.min_n, min(self.config.max_n, end + 1) + 1):
                self.ends.setdefault(tuple(self.history[end - n + 1 :]), []).append(end)

    def continuations(self) -> list[tuple[int, ...]]:
        """Distinct continuations of the earlier occurrences of the history's suffix: longest suffix
        first, most recent occurrence first, at most `num_continuations`."""
        length = len(self.history)
        found: list[tuple[int, ...]] = []
        for n in range(min(self.config.max_n, length), self.config.min_n - 1, -1):
            ends = self.ends.get(tuple(self.history[length - n :]), [])
            for end in ends[-2 : -MAX_SCAN - 2 : -1]:  # skip the suffix itself (the last entry)
                continuation = self._continuation(end)
                if continuation not in found:
                    found.append(continuation)
                    if len(found) == self.config.num_continuations:
                        return found
        return found

    def _continuation(self, end: int) -> tuple[int, ...]:
        """The `max_len` tokens after position `end`; past the history's end, the continuation
        repeats itself with the period (length - 1 - end) that the match implies."""
        length = len(self.history)
        out: list[int] = []
        for step in range(1, self.config.max_len + 1):
            pos = end + step
            out.append(self.history[pos] if pos < length else out[pos - length])
        return tuple(out)


class TrieNode:
    """A proposed token: its depth below the root, rank among its siblings, and score."""

    __slots__ = ("children", "depth", "logprob", "rank", "ranked", "token")

    def __init__(self, token: int, depth: int, rank: int) -> None:
        self.token, self.depth, self.rank = token, depth, rank
        self.logprob = 0.0
        self.children: dict[int, TrieNode] = {}  # token -> child, in rank order
        self.ranked: list[TrieNode] = []  # children by descending score (filled by `score_trie`)


def build_trie(continuations: list[tuple[int, ...]]) -> TrieNode:
    """Merge continuations (in priority order) into a prefix tree under a root node (depth 0)."""
    root = TrieNode(-1, 0, 0)
    for continuation in continuations:
        node = root
        for token in continuation:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = TrieNode(token, node.depth + 1, len(node.children))
            node = child
    return root


class ProposalAcceptance:
    """Online acceptance estimate per (depth, rank): hits / trials of proposals whose parent the
    target committed, with a Beta(a, b) prior; `logprobs[d][r]` is the posterior mean's log."""

    def __init__(self, config: NgramConfig) -> None:
        self.alpha = config.prior_accept * config.prior_weight
        self.beta = (1.0 - config.prior_accept) * config.prior_weight
        shape = (config.max_len, config.num_continuations)
        self.hits = [[0] * shape[1] for _ in range(shape[0])]
        self.trials = [[0] * shape[1] for _ in range(shape[0])]
        self.logprobs = [[0.0] * shape[1] for _ in range(shape[0])]
        self._update_logprobs()

    def record(self, root: TrieNode, committed_ids: list[int]) -> None:
        """Score one round's trie against the tokens the target committed after its root."""
        node = root
        for depth, token in enumerate(committed_ids):
            if not node.children:
                break
            for child in node.children.values():
                self.trials[depth][child.rank] += 1
                self.hits[depth][child.rank] += int(child.token == token)
            node = node.children.get(token)
            if node is None:
                break
        self._update_logprobs()

    def _update_logprobs(self) -> None:
        for depth, (hits, trials) in enumerate(zip(self.hits, self.trials)):
            self.logprobs[depth] = [math.log((h + self.alpha) / (t + self.alpha + self.beta))
                                    for h, t in zip(hits, trials)]

    def accept_prob(self, depth: int, rank: int) -> float:
        """Estimated probability that a rank-`rank` proposal at `depth` (1-based) is accepted."""
        return math.exp(self.logprobs[depth - 1][rank])


def score_trie(root: TrieNode, stats: ProposalAcceptance) -> TrieNode:
    """Set every node's score from `stats` and order each node's children by it (stable)."""
    stack = [root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            child.logprob = stats.logprobs[child.depth - 1][child.rank]
        node.ranked = sorted(node.children.values(), key=lambda c: -c.logprob)
        stack.extend(node.children.values())
    return root


class NgramDrafter:
    """`--drafter ngram`: a parameter-free proposer; decoding uses it like any drafter."""

    drafter_type = "ngram"
    reads_aux = False  # reads no target features at all
    proposes_from_context = True
    neural = None  # no weights

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()

    def check_media(self, num_spans: int) -> None:
        """Media tokens are just ids in the history: any number of spans is fine."""

    def target_features(self, aux_hidden: Tensor | None, last_hidden: Tensor) -> Tensor:
        """[B, N, 0]: nothing (a zero-width view, no copy)."""
        return last_hidden[..., :0]

    def new_session(self, batch_size: int) -> NgramSession:
        return NgramSession(self.config, batch_size)


class NgramSession:
    """Per-row histories, this round's tries and the tree frontier's trie nodes (`TreeExpander`)."""

    def __init__(self, config: NgramConfig, batch_size: int) -> None:
        self.config = config
        self.indexes = [NgramIndex(config) for _ in range(batch_size)]
        self.stats = ProposalAcceptance(config)
        self.tries: list[TrieNode | None] = [None] * batch_size  # this round's proposals per row
        self.frontier: list[list[TrieNode | None]] = [[] for _ in range(batch_size)]
        self.device = torch.device("cpu")

    def advance(self, inputs: DraftInputs) -> None:
        """Score last round's proposals against the committed tokens, then append them to the history."""
        self.device = inputs.next_ids.device
        committed = inputs.next_ids.tolist()
        for row, num_new in enumerate(inputs.num_new.tolist()):
            tokens = committed[row][:num_new]
            if self.tries[row] is not None:
                self.stats.record(self.tries[row], tokens)
            self.indexes[row].extend(tokens)
        self.tries = [None] * len(self.indexes)

    def defer(self, inputs: DraftInputs) -> None:
        """Proposing costs nothing here: deferred pairs are taken at once."""
        self.advance(inputs)

    def light_expander(self) -> None:
        """The whole session is light already."""
        return None

    def has_proposals(self) -> bool:
        """Whether any row's history continues an earlier match (a root proposal exists)."""
        return any(index.continuations() for index in self.indexes)

    def root_proposals(self, limit: int, min_width: int) -> tuple[Tensor, Tensor]:
        """The root's best `limit` proposals per row: (ids [B, k], log-probs [B, k]), k >= min_width,
        -inf where a row has fewer."""
        self.tries = [score_trie(build_trie(index.continuations()), self.stats) for index in self.indexes]
        self.frontier = [[root] for root in self.tries]
        ids, logprobs = self._children([[root] for root in self.tries], limit, min_width)
        return ids[:, 0], logprobs[:, 0]

    def expand_proposals(
        self, token_ids: Tensor, parent_slots: Tensor, limit: int, min_width: int
    ) -> tuple[Tensor, Tensor]:
        """Walk the trie to the frontier nodes (parent in the last frontier + token id: a node another
        proposer put there continues too when its token is on the trie); their best children
        (ids [B, K, k], log-probs [B, K, k], k >= min_width, -inf where absent)."""
        frontier = []
        for row, (tokens, slots) in enumerate(zip(token_ids.tolist(), parent_slots.tolist())):
            parents = [self.frontier[row][slot] for slot in slots]
            frontier.append([None if parent is None else parent.children.get(token)
                             for parent, token in zip(parents, tokens)])
        self.frontier = frontier
        return self._children(frontier, limit, min_width)

    def _children(self, nodes: list[list[TrieNode | None]], limit: int, min_width: int) -> tuple[Tensor, Tensor]:
        """ids, log-probs [B, K, k] of the best `limit` children of each node (None: no children)."""
        kids = [[node.ranked[:limit] if node is not None else [] for node in row] for row in nodes]
        width = max([min_width] + [len(k) for row in kids for k in row])
        ids = [[[c.token for c in k] + [PAD_ID] * (width - len(k)) for k in row] for row in kids]
        logprobs = [[[c.logprob for c in k] + [NEG_INF] * (width - len(k)) for k in row] for row in kids]
        num_rows, num_nodes = len(nodes), len(nodes[0]) if nodes else 0
        return (torch.tensor(ids, dtype=torch.long, device=self.device).view(num_rows, num_nodes, width),
                torch.tensor(logprobs, dtype=torch.float32, device=self.device).view(num_rows, num_nodes, width))

    def root_candidates(self, topk: int) -> tuple[Tensor, Tensor]:
        return self.root_proposals(topk, min_width=1)

    def expand(self, token_ids: Tensor, parent_slots: Tensor, block_mask: Tensor, topk: int) -> tuple[Tensor, Tensor]:
        return self.expand_proposals(token_ids, parent_slots, topk, min_width=1)

    def end_round(self) -> None:
        """Tree entries are not cached here; keep the tries until `advance` scores them."""
        self.frontier = [[] for _ in self.indexes]

    def select_rows(self, rows: Tensor) -> None:
        """Keep only batch rows `rows` (finished sequences leave the batch)."""
        keep = rows.tolist()
        self.indexes = [self.indexes[row] for row in keep]
        self.tries = [self.tries[row] for row in keep]
        self.frontier = [self.frontier[row] for row in keep] if self.frontier else []
