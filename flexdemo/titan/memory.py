"""Does a run fit? A per-GPU memory estimate from the config alone (``[flexdemo] memory_check``).

The model is built on the meta device from its train spec's flavor (nothing allocated), so the
parameter shapes are the real ones; the rest follows from the parallel degrees, the dtypes and
the activation-checkpointing mode. Pure functions: :func:`estimate_memory` returns a
:class:`MemoryEstimate` (bytes per GPU, ``line()`` for the log), :func:`check_fit` warns or
refuses. What is counted and what is not: docs/config.md, "Memory estimate".

The sum treats every term as alive at once, which slightly overstates the peak: gradients are
written during the backward while activations are being freed.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torchtitan.config import TORCH_DTYPE_MAP

from flexdemo.modes import PARAM_BYTES, StateBytes, mode_of

from flexdemo.section import FlexDemoConfigError

GIB = 1024**3
# Warn (or refuse) above this share of the device: the estimate leaves out the CUDA context,
# NCCL's buffers and the caching allocator's fragmentation, which take several GiB on a large job.
FIT_FRACTION = 0.9
# PARAM_BYTES (flexdemo.modes): 4, torchtitan keeps fp32 master weights; FSDP casts only the gathered copies
LOGIT_FP32_COPIES = 3  # the loss's backward holds log-probs, their gradient, the logits' gradient (fp32)


@dataclass(frozen=True)
class Degrees:
    replicate: int
    fsdp: int  # shards inside a replica: data_parallel_shard_degree x context_parallel_degree
    tp: int
    cp: int
    pp: int


def degrees(job_config, world_size: int | None) -> Degrees:
    """The parallel degrees, the shard degree -1 resolved against the world size (1 without one)."""
    p = job_config.parallelism
    rest = p.data_parallel_replicate_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree * \
        p.context_parallel_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        shard = max(1, world_size // rest) if world_size else 1
    return Degrees(p.data_parallel_replicate_degree, shard * p.context_parallel_degree,
                   p.tensor_parallel_degree, p.context_parallel_degree, p.pipeline_parallel_degree)


@dataclass(frozen=True)
class ModelShapes:
    params: tuple[tuple[str, tuple[int, ...]], ...]  # every parameter once (tied weights once)
    block: tuple[tuple[int, ...], ...]  # one transformer block's parameters
    head: tuple[tuple[int, ...], ...]  # final norm + output projection: one FSDP unit in torchtitan
    n_layers: int
    dim: int
    q_dim: int  # n_heads x head_dim
    kv_dim: int  # n_kv_heads x head_dim
    ffn_dim: int  # SwiGLU hidden size (MoE: the hidden sizes a token passes through, summed)
    n_heads: int
    n_kv_heads: int
    vocab: int
    qk_norm: bool  # qwen3: RMSNorm on q and k (their inputs are saved too)


def build_meta_model(job_config):
    """The run's model on the meta device: its spec's flavor, updated from the config as the
    trainer does (a copy: the registered flavor stays as it is)."""
    from .spec import FAMILIES, family_spec  # lazy: the specs import the whole plugin

    name = job_config.model.name
    if name in FAMILIES:
        spec = family_spec(FAMILIES[name])
    else:
        from torchtitan.protocols.train_spec import get_train_spec
        spec = get_train_spec(name)
    args = copy.deepcopy(spec.model_args[job_config.model.flavor])
    args.update_from_config(job_config)
    with torch.device("meta"):
        return spec.model_cls(args)


def model_shapes(model) -> ModelShapes:
    """Shapes and the dims the activation estimate needs, read off a (meta) llama3/qwen3 model:
    torchtitan 0.2.2's (``wq``/``wk``/``wv``, ``output``) or 0.3.0's (one fused ``wqkv``, whose
    attention keeps ``n_heads``/``n_kv_heads``/``head_dim``; ``lm_head``)."""
    params = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    block = next(iter(model.layers.values()))
    attn = block.attention
    if hasattr(attn, "wq"):
        q_dim, kv_dim = attn.wq.weight.shape[0], attn.wk.weight.shape[0]
    else:
        q_dim, kv_dim = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    head_dim = q_dim // attn.n_heads
    output = model.output if hasattr(model, "output") else model.lm_head
    if getattr(block, "feed_forward", None) is not None:
        ffn = block.feed_forward.w1.weight.shape[0]
    else:  # MoE (approximate): the routed experts a token visits, plus the shared ones
        margs = model.model_args
        ffn = margs.moe_inter_dim * (margs.moe_args.top_k + margs.moe_args.num_shared_experts)
    head = [tuple(p.shape) for m in (model.norm, output) for p in m.parameters()]
    return ModelShapes(
        params=params, block=tuple(tuple(p.shape) for p in block.parameters()), head=tuple(head),
        n_layers=len(model.layers), dim=model.norm.weight.shape[0], q_dim=q_dim, kv_dim=kv_dim, ffn_dim=ffn,
        n_heads=attn.n_heads, n_kv_heads=kv_dim // head_dim, vocab=output.weight.shape[0],
        qk_norm=getattr(attn, "q_norm", None) is not None,
    )


# Per process, by (model name, flavor): the shapes do not depend on the rest of the config
# (update_from_config sets the RoPE table's length), and a config check may run many times.
_SHAPES: dict[tuple[str, str], ModelShapes] = {}


def shapes_of(job_config) -> ModelShapes:
    return cached_shapes((job_config.model.name, job_config.model.flavor), lambda: build_meta_model(job_config))


def cached_shapes(key: tuple[str, str], build_meta) -> ModelShapes:
    """The ModelShapes of (model name, flavor), the model built on the meta device by ``build_meta()``
    once per process (either torchtitan version's: one runs in a process)."""
    if key not in _SHAPES:
        _SHAPES[key] = model_shapes(build_meta())
    return _SHAPES[key]


def _tp_elements(shape: tuple[int, ...], tp: int) -> int:
    # torchtitan's TP plans shard every matrix (embedding, projections) and replicate the 1-D
    # norm weights (approximate where a dim does not divide by tp).
    n = math.prod(shape)
    return n if len(shape) < 2 else -(-n // tp)


def local_elements(shapes, fsdp: int, tp: int) -> int:
    """Elements one GPU holds: TP's share, then FSDP's dim-0 shard (the first rank's, padded up)."""
    total = 0
    for shape in shapes:
        n = _tp_elements(shape, tp)
        rows = shape[0] if shape else 1
        total += -(-rows // fsdp) * (n // rows) if rows else 0
    return total


def gathered_elements(shapes, tp: int) -> int:
    """Elements of an FSDP unit while it is all-gathered (still TP-sharded)."""
    return sum(_tp_elements(s, tp) for s in shapes)


def optimizer_state_bytes(cfg) -> StateBytes:
    """Per-element optimizer state of the mode, as its code creates it (each tensor shaped like the
    local shard of the parameter, in its dtype unless said): its entry in flexdemo.modes."""
    return mode_of(cfg).state_bytes(cfg)


def block_activation_bytes(s: ModelShapes, tokens: int, act: int, tp: int) -> int:
    """What autograd keeps for one llama3/qwen3 block with no checkpointing, for ``tokens`` tokens
    (``act``: bytes of the compute dtype). Per token, from the model code:
      attention_norm / ffn_norm save their inputs x, h (d each, sequence-sharded under TP) and an
        fp32 rstd each;
      wq/wk/wv save the normed x, w1/w3 the normed h (d each; under TP's sequence parallelism the
        all-gathered input, so not divided by TP);
      SDPA (flash/efficient: no seq^2 scores) saves q, k, v after RoPE, its output (which wo
        saves too: the same storage) and an fp32 log-sum-exp per head;
      qwen3's q_norm/k_norm save the projections they normalise (q, kv) and an fp32 rstd per head;
      SwiGLU saves w1's and w3's outputs, silu(w1 x), and their product (w2's input): 4 f;
      RoPE multiplies by a constant table and saves nothing of size.
    """
    sharded = 2 * s.dim + 2 * s.q_dim + 2 * s.kv_dim + 4 * s.ffn_dim
    fp32 = 2 + s.n_heads
    if s.qk_norm:
        sharded += s.q_dim + s.kv_dim
        fp32 += s.n_heads + s.n_kv_heads
    return tokens * (act * sharded + 4 * fp32) // tp + tokens * act * 2 * s.dim


def selective_saved_bytes(s: ModelShapes, tokens: int, act: int, tp: int) -> int:
    """torchtitan's op-level selective AC keeps per block its input and the outputs of every other
    matmul (wq, wv, w1, w2: the 1st, 3rd, 5th, 7th) and of SDPA (output + log-sum-exp); the rest
    is recomputed in the backward."""
    saved = s.dim + s.q_dim + s.kv_dim + s.ffn_dim + s.dim + s.q_dim
    return tokens * (act * saved + 4 * s.n_heads) // tp


def activation_bytes(s: ModelShapes, tokens: int, act: int, tp: int, ac_mode: str, ac_option: str) -> int:
    """All blocks' saved activations under ``[activation_checkpoint]``, plus the final norm's (its
    input and rstd, and its output saved by the output projection). A checkpointed block keeps its
    input (sequence-sharded under TP) and, while the backward recomputes it, one block's full set."""
    block = block_activation_bytes(s, tokens, act, tp)
    block_input = tokens * act * s.dim // tp
    final_norm = tokens * (act * s.dim + 4) // tp + tokens * act * s.dim
    L = s.n_layers
    if ac_mode == "full":
        return L * block_input + block + final_norm
    if ac_mode == "selective" and ac_option == "op":
        return L * selective_saved_bytes(s, tokens, act, tp) + block + final_norm
    if ac_mode == "selective":  # every N-th block fully checkpointed (0: all of them)
        every = int(ac_option)
        checkpointed = L if every == 0 else L // every
        return (L - checkpointed) * block + checkpointed * block_input + (block if checkpointed else 0) + final_norm
    return L * block + final_norm  # "none"; "memory_budget" (compiled) counted as none: an upper bound


def autocast_copies(s: ModelShapes, ac) -> int:
    """Elements of autocast's bf16 weight casts alive at the backward's start. Without activation
    checkpointing autograd keeps every matmul weight's cast until that matmul's backward (not the
    embedding's: no matmul). A checkpointed block saves its input only: its casts go with autocast's
    cache when the forward ends and are remade one block at a time in the backward (measured at
    8B on one H200, full AC: +15% with every cast counted, +3% with one block's)."""
    matmuls = sum(math.prod(shape) for name, shape in s.params if len(shape) >= 2 and not name.startswith("tok_embeddings"))
    block = sum(math.prod(shape) for shape in s.block if len(shape) >= 2)
    outside = matmuls - s.n_layers * block  # the output projection: never checkpointed
    if ac.mode == "full" or (ac.mode == "selective" and ac.selective_ac_option == "op"):
        held = 1  # the block being recomputed
    elif ac.mode == "selective":
        every = int(ac.selective_ac_option)
        checkpointed = s.n_layers if every == 0 else s.n_layers // every
        held = s.n_layers - checkpointed + (1 if checkpointed else 0)
    else:
        held = s.n_layers
    return held * block + outside


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    grads: int
    optimizer: int
    compute_copies: int
    activations: int
    logits: int
    host_state: int  # optimizer state in host memory: not in the GPU total
    device_total: int | None  # None: no GPU visible, the fit is not judged
    device_name: str
    context: str  # what the estimate assumed, for the line

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.compute_copies + self.activations + self.logits

    @property
    def limit(self) -> int | None:
        return None if self.device_total is None else int(FIT_FRACTION * self.device_total)

    @property
    def over(self) -> bool:
        return self.limit is not None and self.total > self.limit

    def line(self) -> str:
        """One line, ``key=<GiB>GiB`` fields first (parse with ``(\\w+)=([0-9.]+)GiB``)."""
        fields = ("params", "grads", "optimizer", "compute_copies", "activations", "logits", "total")
        parts = [f"{k}={gib(getattr(self, k))}GiB" for k in fields]
        if self.device_total is None:
            device = f"device={self.device_name} (no GPU: fit not judged)"
        else:
            device = (f"device={gib(self.device_total)}GiB ({self.device_name}, "
                      f"{100 * self.total / self.device_total:.0f}% used, limit {FIT_FRACTION:.0%})")
        host = f" host_state={gib(self.host_state)}GiB (optimizer state in host memory, not in total)" \
            if self.host_state else ""
        return f"flexdemo: memory per GPU (estimate): {' '.join(parts)} {device}{host} [{self.context}]"


def gib(n: int) -> str:
    return f"{n / GIB:.3f}"


def compute_setup(job_config, d: Degrees) -> tuple[int, bool, bool]:
    """(bytes of the activations' dtype, FSDP on, autocast on), as torchtitan 0.2.2 decides: FSDP
    casts the gathered weights to mixed_precision_param; without FSDP, AMP autocasts unless TP or
    PP is on (then everything runs in fp32)."""
    mp = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param].itemsize
    if d.fsdp > 1:
        return mp, True, False
    if d.tp > 1 or d.pp > 1:
        return PARAM_BYTES, False, False
    return mp, False, mp < PARAM_BYTES


def estimate_memory(job_config, world_size: int | None, device_total: int | None = None,
                    device_name: str = "CPU", shapes: ModelShapes | None = None) -> MemoryEstimate:
    """Bytes per GPU for the parsed job config (``shapes``: built from its flavor when not given)."""
    cfg = job_config.flexdemo
    s = shapes or shapes_of(job_config)
    d = degrees(job_config, world_size)
    act, fsdp_on, autocast = compute_setup(job_config, d)
    mp = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param].itemsize
    reduce = TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce].itemsize
    shapes_all = [shape for _, shape in s.params]
    local = local_elements(shapes_all, d.fsdp, d.tp)
    params = PARAM_BYTES * local
    grads = PARAM_BYTES * local
    copies = 0
    if fsdp_on:
        # Gathered weights in flight: the current block and the next one (prefetch); the head
        # unit stays gathered from its forward into the backward (not resharded after forward).
        block, head = gathered_elements(s.block, d.tp), gathered_elements(s.head, d.tp)
        copies = mp * (block + max(block, head))
        # The largest unit's unsharded gradient before its reduce-scatter: autograd's (compute
        # dtype) and the reduce-scatter input (reduce dtype).
        grads += (mp + reduce) * max(block, head)
    elif autocast:
        copies = mp * autocast_copies(s, job_config.activation_checkpoint)
    if not mode_of(cfg).separate_replicas and not fsdp_on and d.replicate > 1:
        grads += PARAM_BYTES * local  # DDP's gradient buckets (torchtitan's replicate: not views)
    state = optimizer_state_bytes(cfg)
    t = job_config.training
    tokens = t.local_batch_size * t.seq_len // d.cp
    ac = job_config.activation_checkpoint
    activations = activation_bytes(s, tokens, act, d.tp, ac.mode, ac.selective_ac_option)
    loss_parallel = d.tp > 1 and not job_config.parallelism.disable_loss_parallel
    logits = LOGIT_FP32_COPIES * 4 * tokens * -(-s.vocab // (d.tp if loss_parallel else 1))
    ac_text = ac.mode + (f" {ac.selective_ac_option}" if ac.mode == "selective" else "")
    ac_text += " (counted as none)" if ac.mode == "memory_budget" else ""
    unmodelled = ", pp/ep not modelled" if d.pp > 1 or job_config.parallelism.expert_parallel_degree > 1 else ""
    context = (f"{job_config.model.name} {job_config.model.flavor}, mode {cfg.mode}, fsdp {d.fsdp} x tp {d.tp}, "
               f"batch {t.local_batch_size} x seq {t.seq_len}, AC {ac_text}, activations {act} B/elt{unmodelled}")
    return MemoryEstimate(
        params=params, grads=grads, optimizer=state.device * local, compute_copies=copies,
        activations=activations, logits=logits, host_state=state.host * local,
        device_total=device_total, device_name=device_name, context=context,
    )


def check_fit(estimate: MemoryEstimate, memory_check: str) -> str | None:
    """``"refuse"``: raise FlexDemoConfigError when the estimate is over the limit; ``"warn"``: the
    warning line to print (None when it fits, or when no GPU memory is known)."""
    if memory_check == "off" or not estimate.over:
        return None
    what = (f"the estimated memory per GPU, {gib(estimate.total)} GiB, is over {FIT_FRACTION:.0%} of the "
            f"device's {gib(estimate.device_total)} GiB ({estimate.device_name}); lower "
            "training.local_batch_size or seq_len, checkpoint activations, shard more, or keep the "
            "optimizer state in host memory ([flexdemo] momentum_device / outer_state_device = \"cpu\"; "
            "the estimate per term is on the memory line)")
    if memory_check == "refuse":
        raise FlexDemoConfigError(f"[flexdemo] config error: memory_check = \"refuse\": {what}")
    return f"flexdemo: WARNING: {what}; the run may run out of memory ([flexdemo] memory_check)"


def visible_device() -> tuple[int | None, str]:
    """(the smallest visible GPU's memory in bytes, its name), or (None, "CPU")."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None, "CPU"
    props = min((torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())),
                key=lambda p: p.total_memory)
    return props.total_memory, props.name


def check(job_config, world_size: int | None, say, shapes=None) -> None:
    """``[flexdemo] memory_check``: the estimate's line (``say``), then a warning or (``"refuse"``) a
    FlexDemoConfigError when it is over the limit (a 0.2.2 job config, or 0.3.0's seen through
    0.2.2's names: flexdemo.titan.v0_3.memory; ``shapes``: a function giving its ModelShapes, where
    the caller reads them; else from the 0.2.2 train spec)."""
    memory_check = job_config.flexdemo.memory_check
    if memory_check == "off":
        return
    total, name = visible_device()
    try:
        estimate = estimate_memory(job_config, world_size, total, name, shapes=shapes and shapes())
    except Exception as e:  # a model the estimator cannot read must not stop a launch, unless asked to
        if memory_check == "refuse":
            raise FlexDemoConfigError(
                f"[flexdemo] config error: memory_check = \"refuse\" but no estimate: {type(e).__name__}: {e}")
        say(f"flexdemo: memory per GPU not estimated ({type(e).__name__}: {e})")
        return
    say(estimate.line())
    warning = check_fit(estimate, memory_check)  # raises with "refuse"
    if warning:
        say(warning)
