"""What the planner knows from measurements: GPUs' memory, compute steps per flavor and GPU, the
codec and outer-step costs, and the held-out loss each setting reached against AdamW. Every
number names where it was measured (docs/results.md sections, docs/results/ folders); rows that
were not measured say "modelled" and how. tests/test_plan.py recomputes the measured ones from
docs/results/ where the data is there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .intervals import Interval, paired_interval

MIB = 1024**2

# Device memory as torch reports it (total_memory), by the name --gpu takes.
GPU_MEMORY = {
    "H100": 81559 * MIB,  # NVIDIA H100 80GB HBM3
    "H200": 143771 * MIB,  # NVIDIA H200 (docs/results/outer_transform_1b_h200/meta.json)
}


@dataclass(frozen=True)
class ComputeStep:
    """One training step on one GPU without replica traffic (forward, backward, AdamW)."""
    seconds: float
    tokens_per_gpu: int  # local_batch_size x seq_len of the measured run
    seq_len: int
    activation_checkpoint: str  # its AC mode
    source: str
    modelled: bool = False


# By (flavor, GPU). The planner scales a row by the config's tokens per GPU per step.
COMPUTE_STEPS = {
    ("small", "H200"): ComputeStep(
        8192 / 139_171, 8192, 1024, "none", "AdamW, one replica on 1 x H200, 200 steps (docs/results/compute_h200)"),
    ("1B", "H200"): ComputeStep(
        8192 / 64_158, 8192, 1024, "none", "AdamW, one replica on 1 x H200, 200 steps (docs/results/compute_h200)"),
    ("8B", "H200"): ComputeStep(
        8192 / 7_603, 8192, 4096, "full", "AdamW, one replica (8.03 B) on 1 x H200, 25 steps (docs/results/compute_h200)"),
    ("small", "H100"): ComputeStep(
        0.090, 8192, 1024, "none", "DiLoCo inner steps (AdamW, no replica traffic), 4 x H100, median "
                                   "(docs/results/link_4node_1gbit, diloco)"),
    ("1B", "H100"): ComputeStep(
        8192 / 64_158, 8192, 1024, "none",
        "modelled: the H200's step (the same GH100 compute; the H200's faster memory ignored)", modelled=True),
    ("8B", "H100"): ComputeStep(
        8192 / 7_603, 8192, 4096, "full",
        "modelled: the H200's step (the same GH100 compute; the H200's faster memory ignored)", modelled=True),
}

@dataclass(frozen=True)
class PerParamCost:
    """Seconds of GPU work per local parameter (an optimizer's extra over AdamW, or one outer step)."""
    seconds_per_param: float
    source: str


# DeMo.step's time over AdamW's per step, the whole model on one GPU: measured per flavor (one
# replica on 1 x H200, the runs of COMPUTE_STEPS: 8192 / 125,183 - 8192 / 139,171 s at small,
# 8192 / 59,778 - 8192 / 64,158 s at 1B, 8192 / 7,081 - 8192 / 7,603 s at 8B); other flavors per parameter, 30.4 vs 16.8 ms at 1.50 B
# (1 x H100, docs/results.md 4, optimizer_step_h100/step_1.json). A shard costs its share, and at
# least the small flavor's whole extra (kernel launches, not elements, set the cost there).
DEMO_STEP_EXTRA_MEASURED = {"small": 8192 / 125_183 - 8192 / 139_171, "1B": 8192 / 59_778 - 8192 / 64_158,
                            "8B": 8192 / 7_081 - 8192 / 7_603}
DEMO_STEP_EXTRA = PerParamCost((30.402 - 16.804) * 1e-3 / 1_498_482_688, "docs/results/optimizer_step_h100/step_1.json")


def demo_step_extra(flavor: str, local_params: int, model_params: int) -> float:
    if flavor in DEMO_STEP_EXTRA_MEASURED:
        whole = DEMO_STEP_EXTRA_MEASURED[flavor]
    else:
        whole = DEMO_STEP_EXTRA.seconds_per_param * model_params
    return max(DEMO_STEP_EXTRA_MEASURED["small"], whole * local_params / model_params)


# One DiLoCo outer step (codec + outer SGD; the exchange's time is the link model's), 1B = 0.98 B
# parameters, 1 x H200 (docs/results.md 4): dense bf16 35.7 ms (2 replicas, NVLink, exchange
# included: an upper bound), top-k on the fused kernels 87.5 ms (top-256 scaled_sign), top-k on
# the torch path (two_bit, fp32, bf16 values) 156.2 ms.
OUTER_STEP = {
    "dense": PerParamCost(35.684e-3 / 981_534_720, "docs/results/outer_step_h200/outer_step_all.json"),
    "topk_fused": PerParamCost(87.474e-3 / 981_534_720, "docs/results/outer_transform_1b_h200/dct_scaled_sign_k256.json"),
    "topk_torch": PerParamCost(156.223e-3 / 981_534_720, "docs/results/outer_transform_1b_h200/none_two_bit_k64.json"),
}
FUSED_ENCODINGS = ("sign", "scaled_sign")  # flexdemo.compression.paths.FUSED_ENCODINGS


# The corpus whose held-out loss counts (flexdemo.data.pysource2). Version 1's held-out set did not
# measure generalisation (docs/data.md): its costs are listed, and never recommend a mode.
COMPARISON_CORPUS = 2


@dataclass(frozen=True)
class LossCost:
    """Held-out loss of a setting against AdamW-DDP at equal tokens, per seed (fractions), on
    ``corpus``'s held-out set."""
    mode: str
    settings: dict = field(hash=False)  # [flexdemo] keys that must match (exchange included)
    vs_adamw: tuple[float, ...]
    where: str  # scale and section
    runs: tuple[str, ...] = ()  # each seed's run in docs/results/, FOLDER/NAME_sSEED (AdamW's: FOLDER/adamw_sSEED)
    corpus: int = 1

    @property
    def interval(self) -> Interval:
        return paired_interval(self.vs_adamw)

    def within(self, tolerance: float) -> bool:
        """Whether the claim "within ``tolerance`` of AdamW" holds: measured on the comparison
        corpus, and the 95% interval over its paired seeds ends at or below ``tolerance``."""
        return self.corpus == COMPARISON_CORPUS and self.interval.high <= tolerance

    def text(self) -> str:
        seeds = " / ".join(f"{d:+.1%}" for d in self.vs_adamw)
        return f"{seeds}, mean {self.interval.text()} ({self.where}; corpus {self.corpus})"


def _runs(folder: str, name: str, seeds: tuple[int, ...]) -> tuple[str, ...]:
    """Each seed's run of a setting in docs/results/FOLDER (runs named NAME_sSEED)."""
    return tuple(f"{folder}/{name}_s{seed}" for seed in seeds)


VERSION1_SEEDS = (1234, 4321, 5678)  # corpus version 1's, which its settings were tuned on
CLAIM_SEEDS = (11, 22, 33, 44)  # the comparison corpus's, no setting tuned on them
# The settings several costs share; their variations below change a few keys, in place.
TOP16 = {"exchange": "allgather", "topk": 16, "value_encoding": "sign", "overlap": False}
TOP32 = {**TOP16, "topk": 32}
DEMO_DILOCO_DCT = {"exchange": "allgather", "sync_interval": 16, "outer_topk": 256,
                   "outer_value_encoding": "scaled_sign", "outer_transform": "dct", "outer_lr": 1.0}
SPARSELOCO = {"exchange": "allgather", "sync_interval": 30, "outer_topk": 64, "outer_value_encoding": "two_bit",
              "outer_transform": "none", "outer_lr": 1.0}
SPARSELOCO_OLR3 = {**SPARSELOCO, "outer_lr": 3.0}
SPARSELOCO_OLR3_H16_TOP32 = {**SPARSELOCO_OLR3, "sync_interval": 16, "outer_topk": 32}

LOSS_COSTS = (
    LossCost("demo", TOP32, (-0.041, -0.053), "1B, W = 2, 1024 steps, results.md 1.1"),
    LossCost("demo", TOP16, (-0.010, -0.011), "1B, W = 2, 1024 steps, results.md 1.6"),
    LossCost("demo", {**TOP32, "exchange": "sharded"}, (0.11, 0.24), "small, W = 4, 1000 steps, results.md 5"),
    LossCost("demo", {**TOP32, "overlap": True}, (0.188,), "small, W = 2, results.md 1.2"),
    LossCost("diloco", {"sync_interval": 32, "outer_value_encoding": "bf16"},
             (0.143,), "1B, W = 2, 1024 steps, results.md 2"),
    LossCost("demo_diloco", DEMO_DILOCO_DCT, (-0.010, -0.020), "1B, W = 2, 1024 steps, results.md 3.1"),
    LossCost("demo_diloco", SPARSELOCO, (0.189, 0.068), "small, W = 2, 3990 steps, results.md 10",
             _runs("long_small_shared_h200", "sparseloco", VERSION1_SEEDS[:2])),
    # SparseLoCo's recipe at outer lr 2 and 3 (--flexdemo.outer_lr on the preset)
    LossCost("demo_diloco", {**SPARSELOCO, "outer_lr": 2.0}, (-0.086, -0.144, 0.029),
             "small, W = 2, 3990 steps, results.md 10",
             _runs("long_small_shared_h200", "sparseloco_olr2", VERSION1_SEEDS)),
    LossCost("demo_diloco", SPARSELOCO_OLR3, (-0.112, -0.054, 0.006), "small, W = 2, 3990 steps, results.md 10",
             _runs("long_small_shared_h200", "sparseloco_olr3", VERSION1_SEEDS)),
    # The same on the comparison corpus, claim seeds (1 x H100, results.md 11)
    LossCost("demo_diloco", SPARSELOCO_OLR3, (0.046, 0.063, 0.039, 0.048), "small, W = 2, 3990 steps, results.md 11",
             _runs("pysource2_frontier_h100", "sparseloco_olr3", CLAIM_SEEDS), corpus=2),
    # demo_diloco's DCT top-256 recipe at H = 30 on the comparison corpus, claim seeds (1 x H100, results.md 11)
    LossCost("demo_diloco", {**DEMO_DILOCO_DCT, "sync_interval": 30, "outer_lr": 1.5}, (0.041, 0.037, 0.013, 0.035),
             "small, W = 2, 3990 steps, results.md 11",
             _runs("pysource2_frontier_h100", "demo_diloco_h30", CLAIM_SEEDS), corpus=2),
    # about the same bytes as H = 30 top-64: one seed on corpus version 1, claim seeds 11 / 22 / 33 on the
    # comparison corpus (44 not run)
    LossCost("demo_diloco", SPARSELOCO_OLR3_H16_TOP32, (-0.030,), "small, W = 2, 3990 steps, results.md 10",
             _runs("long_small_shared_h200", "sparseloco_olr3_h16_top32", VERSION1_SEEDS[2:])),
    LossCost("demo_diloco", SPARSELOCO_OLR3_H16_TOP32, (0.060, 0.067, 0.042),
             "small, W = 2, 3990 steps, results.md 11",
             _runs("pysource2_frontier_h100", "sparseloco_olr3_h16_top32", CLAIM_SEEDS[:3]), corpus=2),
    # per-step top-16 on the comparison corpus, claim seeds (1 x H100, results.md 11)
    LossCost("demo", TOP16, (0.014, 0.044, 0.021, 0.005), "small, W = 2, 3990 steps, results.md 11",
             _runs("pysource2_frontier_h100", "top16", CLAIM_SEEDS), corpus=2),
    LossCost("demo_diloco", {**SPARSELOCO, "outer_topk": 48, "outer_lr": 2.0}, (-0.022, -0.081, 0.069),
             "small, W = 2, 3990 steps, results.md 10",
             _runs("long_small_shared_h200", "sparseloco_olr2_top48", VERSION1_SEEDS)),
)
# A setting is recommended only where the 95% interval of its paired seeds' held-out loss against
# AdamW's, on the comparison corpus, ends at or below +1%.
LOSS_TOLERANCE = 0.01


def loss_cost(mode: str, keys: dict) -> LossCost | None:
    """The measured cost of these settings (``keys``: the row's [flexdemo] values), or None; the
    comparison corpus's where both corpora measured them (version 1's never counts)."""
    found = [c for c in LOSS_COSTS if c.mode == mode and all(keys.get(k) == v for k, v in c.settings.items())]
    return next((c for c in found if c.corpus == COMPARISON_CORPUS), found[0] if found else None)
