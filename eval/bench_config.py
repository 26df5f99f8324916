"""The settings of one `mmvsd bench` run (light: no torch import, so the CLI parser stays fast)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmvsd.errors import UserError
from mmvsd.eval.suites import is_multimodal, resolve_suite

METHODS = ("vanilla", "hf", "pld", "assisted", "tree")
TEXT_TREE = (60, 7, 10)  # the paper's tree for LLM targets: budget, depth, top-k
IMAGE_TREE = (60, 5, 8)  # and for LLaVA (image targets)


@dataclass
class BenchConfig:
    """Everything one `mmvsd bench` run decides (saved with its results)."""

    suite: str = "text"
    target: str = ""  # "": smol-llava for suites with images, else smollm2-135m
    drafters: list[str] = field(default_factory=list)  # []: the target's shipped drafter, else random (untrained)
    methods: list[str] = field(default_factory=lambda: ["vanilla", "hf", "pld", "tree"])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    limit: int = 0  # items per benchmark (0: all)
    batch_size: int = 1  # own loops decode this many prompts together; HF baselines run one by one
    max_new_tokens: int = 256
    trees: list[str] = field(default_factory=lambda: ["auto"])  # per tree row: auto | paper | BUDGET/DEPTH/TOPK
    assistant: str = ""  # a model with the target's tokenizer for `assisted`
    adapter: str = ""  # modality adapter for image items ("": the first that fits the target)
    seed: int = 0
    out: str = "bench-results"
    device: str = "auto"  # where the target (and every method) runs: auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | fp32 | bf16 | fp16 (auto: bf16 on a GPU, fp32 on the CPU)

    def validate(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise UserError(f"unknown method(s) {', '.join(unknown)}; valid: {', '.join(METHODS)}")
        if "vanilla" not in self.methods:
            raise UserError("--methods must include vanilla: it is the speed-up denominator")
        if "assisted" in self.methods and not self.assistant:
            raise UserError("--methods assisted needs --assistant MODEL (a draft model with the target's tokenizer)")
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.limit < 0:
            raise UserError("--batch-size and --max-new-tokens must be >= 1, --limit >= 0")
        if not self.trees or len(set(self.trees)) != len(self.trees):
            raise UserError(f"--tree needs distinct shapes, got {','.join(self.trees) or 'none'}")
        for spec in self.trees:
            tree_parts(spec)
        resolve_suite(self.suite)

    def target_name(self) -> str:
        """The target to load: as given, else smol-llava for suites with images and smollm2-135m for text."""
        return self.target or ("smol-llava" if is_multimodal(resolve_suite(self.suite)) else "smollm2-135m")


def fixed_tree_spec(budget: int | None, depth: int | None, topk: int | None) -> str | None:
    """The `--tree` entry of a shape given as the older budget / depth / topk parts (unset or 0: the paper's
    value), or None when no part is given."""
    parts = (budget, depth, topk)
    return "/".join(str(value or 0) for value in parts) if any(parts) else None


def tree_shape(spec: str, multimodal: bool):
    """The draft tree of a `--tree` entry on a text or an image benchmark: "auto", or a TreeShape whose parts
    left at 0 (all of them for "paper") take the paper's value for the benchmark's kind."""
    from mmvsd.decoding.tree import TreeShape  # imports torch: this module stays light so the CLI parser stays fast

    parts = tree_parts(spec)
    if parts is None:
        return "auto"
    default = IMAGE_TREE if multimodal else TEXT_TREE
    return TreeShape(*(value or fallback for value, fallback in zip(parts, default)))


def tree_parts(spec: str) -> tuple[int, int, int] | None:
    """(budget, depth, topk) of a `--tree` entry, 0 for the paper's value; None for "auto" (UserError if malformed)."""
    if spec == "auto":
        return None
    if spec == "paper":
        return (0, 0, 0)
    try:
        parts = tuple(int(part) for part in spec.split("/"))
    except ValueError:
        parts = ()
    if len(parts) != 3 or min(parts) < 0:
        raise UserError(f"--tree {spec!r}: expected auto, paper or BUDGET/DEPTH/TOPK (e.g. 60/7/10)")
    return parts
