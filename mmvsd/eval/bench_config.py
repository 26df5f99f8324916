"""The settings of one `mmvsd bench` run (light: no torch import, so the CLI parser stays fast)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmvsd.errors import UserError
from mmvsd.eval.suites import is_multimodal, resolve_suite
from mmvsd.tree_options import tree_parts

METHODS = ("vanilla", "hf", "pld", "assisted", "tree")


@dataclass
class BenchConfig:
    """Everything one `mmvsd bench` run decides (saved with its results)."""

    suite: str = "text"
    target: str = ""  # "": smol-llava for suites with images, else smollm2-135m
    drafters: list[str] = field(default_factory=list)  # []: the target's default (`has_default`), else random
    methods: list[str] = field(default_factory=lambda: ["vanilla", "hf", "pld", "tree"])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    limit: int = 0  # items per benchmark (0: all)
    batch_size: int = 1  # own loops decode this many prompts together; HF baselines run one by one
    max_new_tokens: int = 256
    trees: list[str] = field(default_factory=lambda: ["auto"])  # per tree row: a spec of mmvsd.tree_options
    assistant: str = ""  # a model with the target's tokenizer for `assisted`
    adapter: str = ""  # modality adapter for image items ("": the first that fits the target)
    seed: int = 0
    out: str = "bench-results"
    device: str = "auto"  # where the target (and every method) runs: auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | fp32 | bf16 | fp16 (auto: bf16 on a GPU, fp32 on the CPU)
    engine: str = "mmvsd"  # where the methods decode, by name (mmvsd.decoding.engines: mmvsd, llama.cpp, plugins')
    chain: str = "llama"  # llama.cpp rows: draft length N/PMIN (n_max, p_min), or llama (llama.cpp's defaults)

    def validate(self) -> None:
        from mmvsd.decoding.engines import get_engine  # the plugins' engines too: a run's check, not the parser's

        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise UserError(f"unknown method(s) {', '.join(unknown)}; valid: {', '.join(METHODS)}")
        if get_engine(self.engine).batch_one and self.batch_size != 1:
            raise UserError(f"--engine {self.engine} decodes one prompt at a time: drop --batch-size")
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
        self.check_names()

    def check_names(self) -> None:
        """UserError for a drafter, an adapter or an engine's file that names nothing (before a target loads)."""
        from mmvsd.adapters import check_adapter  # torch: a run's check, not the parser's
        from mmvsd.decoding.engines import get_engine  # likewise
        from mmvsd.drafters.spec import check_drafter_spec  # likewise
        from mmvsd.target_loader import check_target_spec  # likewise

        check_adapter(self.adapter)
        if "assisted" in self.methods:
            check_target_spec(self.assistant)
        for spec in self.drafters:
            check_drafter_spec(spec, self.target_name())
        get_engine(self.engine).check_bench(self)

    def target_name(self) -> str:
        """The target to load: as given, else smol-llava for suites with images and smollm2-135m for text."""
        return self.target or ("smol-llava" if is_multimodal(resolve_suite(self.suite)) else "smollm2-135m")
