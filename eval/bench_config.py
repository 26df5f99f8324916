"""The settings of one `mmvsd bench` run (light: no torch import, so the CLI parser stays fast)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmvsd.errors import UserError
from mmvsd.eval.suites import resolve_suite

METHODS = ("vanilla", "hf", "pld", "assisted", "tree")
TEXT_TREE = (60, 7, 10)  # the paper's tree for LLM targets: budget, depth, top-k
IMAGE_TREE = (60, 5, 8)  # and for LLaVA (image targets)


@dataclass
class BenchConfig:
    """Everything one `mmvsd bench` run decides (saved with its results)."""

    suite: str = "text"
    target: str = ""  # "": smol-llava for suites with images, else smollm2-135m
    drafters: list[str] = field(default_factory=lambda: ["random"])
    methods: list[str] = field(default_factory=lambda: ["vanilla", "hf", "pld", "tree"])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    limit: int = 0  # items per benchmark (0: all)
    batch_size: int = 1  # own loops decode this many prompts together; HF baselines run one by one
    max_new_tokens: int = 256
    tree_budget: int = 0  # 0: the paper's shape for the benchmark's kind (TEXT_TREE / IMAGE_TREE)
    tree_depth: int = 0
    tree_topk: int = 0
    assistant: str = ""  # a model with the target's tokenizer for `assisted`
    adapter: str = ""  # modality adapter for image items ("": the first that fits the target)
    seed: int = 0
    out: str = "bench-results"

    def validate(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise UserError(f"unknown method(s) {', '.join(unknown)}; valid: {', '.join(METHODS)}")
        if "vanilla" not in self.methods:
            raise UserError("--methods must include vanilla: it is the speed-up denominator")
        if "assisted" in self.methods and not self.assistant:
            raise UserError("--methods assisted needs --assistant MODEL (a draft model with the target's tokenizer)")
        if "tree" in self.methods and not self.drafters:
            raise UserError("--methods tree needs at least one --drafter")
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.limit < 0:
            raise UserError("--batch-size and --max-new-tokens must be >= 1, --limit >= 0")
        if min(self.tree_budget, self.tree_depth, self.tree_topk) < 0:
            raise UserError("--tree-budget, --tree-depth and --tree-topk must be >= 1 (0: the paper's default)")
        resolve_suite(self.suite)

    def tree_shape(self, multimodal: bool):
        """The draft tree for a text or an image benchmark: each flag left at 0 takes the paper's value."""
        from mmvsd.tree import TreeShape

        default = IMAGE_TREE if multimodal else TEXT_TREE
        chosen = (self.tree_budget, self.tree_depth, self.tree_topk)
        return TreeShape(*(value or fallback for value, fallback in zip(chosen, default)))
