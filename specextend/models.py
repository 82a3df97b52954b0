"""Models: load a target/draft pair and run one forward under an attention plan.

Loads Hugging Face causal LMs (the families `compat` accepts, decided from both configs and tokenizers before any
weights load) from a local directory (its weights as safetensors, or compact: `compact`), a hub id (only when the
operator allows the hub), or a directory holding one GGUF file. Chooses device, dtype and attention backend, and by
measurement the dtype the target reads a prompt in; keeps a draft to the ids the pair's tokenizer defines.
Never trusts remote code. Knows models and devices; knows nothing of drafting, verification or retrieval.
"""

from __future__ import annotations

import copy
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any
from pathlib import Path

import torch
import transformers
from transformers import (MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig,
                          PreTrainedModel)
from transformers.utils import logging as hf_logging

from . import attention, compact, fusion, heads, signal
from .cache import KVCache
from .compat import PairFacts, check_architecture, check_pair, context_length
from .config import RetrievalSignal
from .fusion import FUSED_ROWS, rms_norm
from .vocab import check_vocab, keep_to_vocab, reduce_output_vocab, tokenizer_digest

# oneDNN, which runs torch's bf16 matmuls on the CPU, keeps a compiled kernel per shape it met, 1,024 by default: a
# bf16 prefill meets new ones at each prompt length (about 1 MB each on the AMX machine), so resident memory crept with
# every new prompt. 16 hold a prefill's linear shapes (the bundled target has five). oneDNN reads this when it first
# runs, so it is set on import.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")  # one formula (fusion.rms_norm)
# the engine hands models its cache as `cache=`: transformers before 5.24 named it `past_key_values` and would
# silently run every forward without the cache
TRANSFORMERS_MIN = (5, 24)
SHARED_EMBEDDING = "shared_embedding"  # config key of a draft cut from its target: it takes the target's embedding
# config key of a draft that ships no tokenizer and reads its target's: the digest (vocab.tokenizer_digest) of the one
# it was trained on, which the target's must match
SHARED_TOKENIZER = "shared_tokenizer"
# CPU default: fp32. On the project's AVX2 machine (no native bf16) a bf16 forward of the 135M target ran
# 4-5x slower than fp32 (README, "Exactness"); bf16 stays available with dtype="bfloat16".
CPU_DTYPE = torch.float32
# rows of the product prefill_dtype times. On the project's busy 2-core AMX machine the bundled target's first MLP took
# 0.7-0.83 of its fp32 time in bf16 over 512 rows (an OpenMP-bound borderline) but a steady 0.37-0.39 over 2048 rows,
# near what a whole prefill gains (0.37-0.45); timing 2048 rows costs ~0.6 s once per process
PREFILL_ROWS = 2048
FASTER = 0.8  # "auto" reads the prompt in bf16 where that took at most this share of the time in fp32
# "auto" keeps a model smaller than this in fp32 untimed: it reads any prompt quickly, and fp32 keeps it exact
MIN_PREFILL_PARAMS = 10_000_000


@dataclass(frozen=True)
class ModelPair:
    target: PreTrainedModel
    draft: PreTrainedModel | None
    device: torch.device
    dtype: torch.dtype
    backend: str  # "flash-attn" or "sdpa": the fused kernels attention.py dispatches to
    load_s: float = 0.0
    calibrated: RetrievalSignal | None = None  # the retrieval signal calibrated for this target (signal.py)

    @property
    def max_positions(self) -> int:
        """The target's context (rope scaling honoured): the only limit on the input, since CMR and StreamingLLM
        keep the draft's working positions compact."""
        return context_length(self.target.config)

    @property
    def draft_positions(self) -> int | None:
        """The draft's own context: a full-cache draft (speculative) runs past it on a longer input."""
        return None if self.draft is None else context_length(self.draft.config)

    @property
    def draft_name(self) -> str:
        """What the draft is called on screen: "draft model", "EAGLE head" or "EAGLE-3 head" ("" without one)."""
        if self.draft is None:
            return ""
        return heads.HEAD_NAME[self.draft.kind] if isinstance(self.draft, heads.EagleHead) else "draft model"

    @property
    def vocab_size(self) -> int:
        return int(self.target.get_output_embeddings().out_features)


def choose_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def choose_dtype(device: torch.device, dtype: str | torch.dtype = "auto") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                 "float16": torch.float16, "fp16": torch.float16}
        if dtype not in names:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16; got {dtype!r}")
        return names[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return CPU_DTYPE


def _source_kwargs(source: str | Path) -> tuple[str, dict]:
    """A directory with config.json, a GGUF file (or a directory holding exactly one), or a hub id."""
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        if (path / "config.json").exists():
            return str(path), {}
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(path), {"gguf_file": ggufs[0].name}
        raise ValueError(f"{path} holds neither config.json nor exactly one .gguf file")
    return str(source), {}


def load_model(
    source: str | Path, device: torch.device, dtype: torch.dtype, device_map: str | None = None,
    target: PreTrainedModel | None = None,
) -> PreTrainedModel:
    """Load a model folder, GGUF or hub id. A draft cut from its target (config `shared_embedding`) ships
    without an embedding and takes `target`'s."""
    name, extra = _source_kwargs(source)
    with _quiet_load_report(cuts_from_target(Path(name))):  # its missing embedding is expected, not a fault
        model = from_pretrained(name, dtype=dtype, attn_implementation=attention.IMPLEMENTATION, device_map=device_map,
                                **extra)
    share_embedding(model, target, source)
    reduce_output_vocab(model, Path(name))
    if device_map is None:
        model.to(device)
    return model.eval()


def from_pretrained(name: str | Path, **kwargs) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(name, **kwargs)`, never trusting remote code; a folder whose weights are
    compact (`compact.weights_file`) gives the same model, built from its config and its tensors dequantized."""
    weights = None if "gguf_file" in kwargs else compact.weights_file(name)
    if weights is None:
        return AutoModelForCausalLM.from_pretrained(str(name), trust_remote_code=False, **kwargs)
    config = AutoConfig.from_pretrained(str(name), trust_remote_code=False)
    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
        None, config=config, state_dict=compact.read(weights), **kwargs)
    if (Path(name) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(name))
    return model


def cuts_from_target(folder: Path) -> bool:
    """Whether a model folder holds a draft that takes its embedding from its target (config `shared_embedding`)."""
    config = folder / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get(SHARED_EMBEDDING, False))


@contextmanager
def _quiet_load_report(quiet: bool):
    """Silence transformers' warnings (its report of missing weights) while `quiet`."""
    level = hf_logging.get_verbosity()
    if quiet:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def share_embedding(draft: PreTrainedModel, target: PreTrainedModel | None, source: str | Path = "the draft") -> None:
    """Give a draft whose config says `shared_embedding` its target's input embedding (and, tied, output layer)."""
    if not getattr(draft.config, SHARED_EMBEDDING, False):
        return
    if target is None:
        raise ValueError(f"{source} takes its embedding from its target: load it together with the target")
    embedding = target.get_input_embeddings()
    if embedding.weight.shape != draft.get_input_embeddings().weight.shape:
        raise ValueError(f"{source} was cut from a target with another embedding shape than this target's")
    draft.set_input_embeddings(embedding)
    draft.get_output_embeddings().weight = embedding.weight


SKINNY_ROWS = 16  # SkinnyLinear's upper bound on rows


class SkinnyLinear(torch.nn.Linear):
    """A Linear that takes a product over a few rows (a verification tree, a draft level) by the faster of
    two CPU paths: the stock GEMM, or `weight @ x.T`, which reads the weight in place.

    Which is faster depends on the CPU. On an AVX2 machine the GEMM packed the whole weight before
    multiplying, which cost more than the product (a 5-row verification of the bundled target at 4K: 234 ms
    stock, 210 ms weight-major; docs/RESULTS.md, "Engine changes"); on an AVX-512 machine the stock path
    was 3x faster for 2 rows of the 49,152-row output layer. So each (shape, rows, dtype) is timed once per
    process, on first use, and the faster path kept. One row and long inputs (prefill) keep the stock path.
    The parameters, their names and their ties are unchanged.
    """

    weight_major: dict[tuple, bool] = {}  # (out, in, rows, dtype) -> the weight-major path is faster here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        if not 1 < rows <= SKINNY_ROWS or x.device.type != "cpu":
            return super().forward(x)
        key = (self.out_features, self.in_features, rows, x.dtype)
        if key not in SkinnyLinear.weight_major:
            stock = super().forward
            SkinnyLinear.weight_major[key] = (attention.best_time(lambda: self._weight_major(x), x.device)
                                              < attention.best_time(lambda: stock(x), x.device))
        if not SkinnyLinear.weight_major[key]:
            return super().forward(x)
        return self._weight_major(x)

    def _weight_major(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        out = (self.weight @ x.reshape(rows, -1).T).T.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias



def reduced_copy(module: torch.nn.Module, dtype: torch.dtype, keep: torch.nn.Module | None = None) -> torch.nn.Module:
    """A copy of `module` with its parameters cast to `dtype` (ties kept; buffers, such as the RoPE frequencies, and
    hooks as they are), sharing no tensor with it but `keep`: a submodule left as it is and fed in its own dtype. A bf16
    prefill builds one (keeping the output layer, whose logits in bf16 would tie the top tokens far more often: bf16
    steps 0.125 apart near 30) and drops it when done."""
    memo: dict[int, Any] = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
                            for m in module.modules() if m is not keep for p in m.parameters(recurse=False)}
    if keep is not None:
        memo[id(keep)] = InOwnDtype(keep)
    return copy.deepcopy(module, memo)


class InOwnDtype(torch.nn.Module):
    """`module`, its input cast to its parameters' dtype."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.to(next(self.module.parameters()).dtype))


def choose_prefill_dtype(setting: str, dtype: torch.dtype, times: tuple[float, float] | None = None) -> torch.dtype:
    """The dtype the target reads a prompt in: its own `dtype`, or bf16 where that is fp32 and `setting` is "on", or
    "auto" and `times` (seconds of the same work in fp32, in bf16) say bf16 took at most FASTER of the fp32 time."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"bf16 prefill must be 'auto', 'on' or 'off', got {setting!r}")
    if dtype != torch.float32 or setting == "off":
        return dtype
    if setting == "on":
        return torch.bfloat16
    if times is None:
        raise ValueError("'auto' chooses by the measured times: pass them")
    fp32_s, bf16_s = times
    return torch.bfloat16 if bf16_s <= FASTER * fp32_s else dtype


PREFILL_TIMES: dict[tuple, tuple[float, float]] = {}  # (device, MLP shapes) -> seconds in fp32, in bf16


def prefill_dtype(model: PreTrainedModel, setting: str = "auto") -> torch.dtype:
    """`choose_prefill_dtype` on this machine, as SkinnyLinear chooses its path: an fp32 model's first MLP block (the
    products that make most of a prefill's work) is timed over PREFILL_ROWS rows in fp32 and in bf16, once per process
    per device and shape, and the faster kept ("auto" leaves a model under MIN_PREFILL_PARAMS in fp32). On the
    project's Xeon with AMX the bundled target read 2.8K tokens in 4.8 s in fp32, 1.8 s in bf16; an AVX2 CPU without
    native bf16 runs bf16 products several times slower."""
    dtype = next(model.parameters()).dtype
    if setting != "auto" or dtype != torch.float32:
        return choose_prefill_dtype(setting, dtype)
    if sum(p.numel() for p in model.parameters()) < MIN_PREFILL_PARAMS:
        return dtype
    mlp = model.base_model.layers[0].mlp
    weight = next(mlp.parameters())
    key = (str(weight.device), tuple(tuple(p.shape) for p in mlp.parameters()))
    if key not in PREFILL_TIMES:
        x = torch.randn(1, PREFILL_ROWS, model.config.hidden_size, device=weight.device)
        reduced, x16 = reduced_copy(mlp, torch.bfloat16), x.to(torch.bfloat16)
        with torch.no_grad():
            PREFILL_TIMES[key] = (attention.best_time(lambda: mlp(x), weight.device),
                                  attention.best_time(lambda: reduced(x16), weight.device))
    return choose_prefill_dtype(setting, dtype, PREFILL_TIMES[key])


fused_rms_norm = attention.compiled_on_cuda(rms_norm)


class FusedRMSNorm(torch.nn.Module):
    """The families' RMSNorm (same formula, same parameters) compiled into one kernel for decode-time forwards,
    where its six elementwise kernels per call cost more than they compute: on an H200 a captured step of a
    7B-shaped target went from 10.2 to 9.1 ms (docs/RESULTS.md, "GPU path"). Prefill keeps the eager formula.
    Swapped in by class on CUDA when Triton is present."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = rms_norm if x.shape[:-1].numel() > FUSED_ROWS else fused_rms_norm
        return norm(x, self.weight, self.variance_epsilon)


def fuses_norms(model: PreTrainedModel) -> bool:
    """Whether `prepare` compiles this model's RMSNorms: on CUDA, with Triton to compile to."""
    return next(model.parameters()).is_cuda and attention.TRITON


def prepare(model: PreTrainedModel | heads.EagleHead) -> PreTrainedModel | heads.EagleHead:
    """Route an already-built model's attention through this project's kernels (a head's goes there from the
    start), its few-row products through SkinnyLinear, and (on CUDA with Triton) its RMSNorms through FusedRMSNorm
    and its decoder layers' decode-time forwards through `fusion.fuse`."""
    if isinstance(model, PreTrainedModel):
        model.set_attn_implementation(attention.IMPLEMENTATION)
    fuse = fuses_norms(model)
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = SkinnyLinear
        elif fuse and type(module).__name__ in NORMS:
            module.__class__ = FusedRMSNorm
    if fuse:
        fusion.fuse(model)
    return model.eval()


def check_transformers(version: str = transformers.__version__) -> None:
    """Refuse a transformers older than the engine's calling convention."""
    found = tuple(int(part) for part in version.split(".")[:2])
    if found < TRANSFORMERS_MIN:
        raise RuntimeError(f"transformers {version} is too old: the engine needs {'.'.join(map(str, TRANSFORMERS_MIN))} "
                           "or newer (.venv/bin/python -m pip install -r requirements.txt; on the GPU machine "
                           "WHEELS=.whl, see docs/GPU.md)")


def make_pair(target: PreTrainedModel, draft: PreTrainedModel | None, load_s: float = 0.0,
              calibrated: RetrievalSignal | None = None, shared_vocab: int | None = None) -> ModelPair:
    """A pair from models already in memory (tests build tiny ones from configs). `shared_vocab`: the ids both
    tokenizers define (`compat.check_pair`); without it the output layers must be the same width."""
    check_transformers()
    for model in (target, draft):
        if model is not None:
            check_architecture(model.config)
    prepare(target)
    if isinstance(draft, heads.EagleHead):  # checked against its target when read (heads.check_folder)
        prepare(draft)
    elif draft is not None:
        if shared_vocab is None:
            check_vocab(target, draft)
        else:
            keep_to_vocab(draft, shared_vocab, target.get_output_embeddings().out_features)
        prepare(draft)
    param = next(target.parameters())
    backend = "flash-attn" if attention.use_flash_attn(param) else "sdpa"
    return ModelPair(target, draft, param.device, param.dtype, backend, load_s, calibrated)


def load_pair(
    target: str | Path, draft: str | Path | None = None, device: str = "auto", dtype: str | torch.dtype = "auto",
    tokenizer: Any = None,
) -> ModelPair:
    """Load both models, once `read_pair` has found them compatible (`tokenizer`: the target's, when the caller has
    read it, so it is not read again). A target too large for one GPU is spread over all GPUs; the draft sits beside
    its first layers."""
    start = time.perf_counter()
    facts = read_pair(target, draft, tokenizer)
    dev = choose_device(device)
    dt = choose_dtype(dev, dtype)
    spread = dev.type == "cuda" and torch.cuda.device_count() > 1
    target_model = load_model(target, dev, dt, device_map="auto" if spread else None)
    first = next(target_model.parameters()).device
    if facts.head is not None:
        draft_model = heads.load_head(draft, target_model, first, dt, facts.head)
    else:
        draft_model = load_model(draft, first, dt, target=target_model) if draft is not None else None
    calibrated = signal.load(draft, signal.target_shape(target_model)) if draft is not None and Path(draft).is_dir() else None
    return make_pair(target_model, draft_model, time.perf_counter() - start, calibrated, facts.shared_vocab)


def read_tokenizer(source: str | Path) -> Any:
    """A model source's tokenizer (a directory, a GGUF file or a folder holding one, or an allowed hub id)."""
    name, extra = _source_kwargs(source)
    if not extra and shared_tokenizer(name) is not None:
        raise ValueError(f"{source} ships no tokenizer: it reads its target's (config {SHARED_TOKENIZER!r}); read the "
                         "target's tokenizer, or load the pair, which does")
    return AutoTokenizer.from_pretrained(name, trust_remote_code=False, **extra)


def shared_tokenizer(folder: str | Path) -> str | None:
    """The digest of the tokenizer a draft folder was trained on when it ships none and reads its target's (config
    SHARED_TOKENIZER), else None."""
    config = Path(folder) / "config.json"
    return json.loads(config.read_text()).get(SHARED_TOKENIZER) if config.is_file() else None


def draft_tokenizer(draft: str | Path, target_tokenizer: Any) -> Any:
    """The target's tokenizer for a draft that reads its target's, once its digest matches the one the draft was
    trained on (ValueError if not); None for a draft with a tokenizer of its own."""
    digest = shared_tokenizer(draft)
    if digest is None:
        return None
    if tokenizer_digest(target_tokenizer) != digest:
        raise ValueError(f"{draft}: it reads its target's tokenizer, but was trained on another one than this "
                         "target's (their ids differ); speculative decoding needs one shared tokenizer")
    return target_tokenizer


def read_pair(target: str | Path, draft: str | Path | None = None, tokenizer: Any = None) -> PairFacts:
    """Read both configs and both tokenizers (no weights; `tokenizer`: the target's, when the caller has read it)
    and decide the pair (`compat.check_pair`); ValueError with the reason when it cannot run."""

    def read(source: str | Path, tokenizer: Any = None) -> tuple:
        name, extra = _source_kwargs(source)
        config = AutoConfig.from_pretrained(name, trust_remote_code=False, **extra)
        try:
            tokenizer = tokenizer if tokenizer is not None else read_tokenizer(source)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{source}: its tokenizer cannot be read ({exc}); a pair is checked by its tokenizers "
                             "before its weights load") from exc
        return config, tokenizer, source

    head = heads.read_head(draft) if draft is not None else None
    if head is None:
        read_target = read(target, tokenizer)
        read_draft = read(draft, draft_tokenizer(draft, read_target[1])) if draft is not None else None
        return check_pair(read_target, read_draft)
    read_target = read(target, tokenizer)  # an EAGLE head ships no tokenizer: it reads the target's ids
    facts = check_pair(read_target, None)
    heads.check_folder(read_target[0], head, draft, str(target))  # its config and its weights' shapes
    return replace(facts, head=head)


def rope_inv_freq(model: PreTrainedModel) -> torch.Tensor:
    """RoPE frequencies (D/2,) of a model, for re-rotating cached keys."""
    return model.base_model.rotary_emb.inv_freq


def final_layer(model: PreTrainedModel) -> tuple[int, float]:
    """(index, softmax scale) of the last attention layer."""
    layers = model.base_model.layers
    return len(layers) - 1, float(layers[-1].self_attn.scaling)


def layer_devices(model: PreTrainedModel) -> tuple[torch.device, ...] | None:
    """Each decoder layer's device, for a model spread over several (None where it sits on one): its KV cache keeps a
    stacked buffer per device (cache.py)."""
    if not isinstance(model, PreTrainedModel):  # an EAGLE head: one layer beside its target's first ones
        return None
    devices = tuple(next(layer.parameters()).device for layer in model.base_model.layers)
    return devices if len(set(devices)) > 1 else None


@torch.no_grad()
def forward(
    model: PreTrainedModel, cache: KVCache, tokens: list[int], positions: torch.Tensor,
    plan: attention.AttentionPlan, logits_to_keep: int = 0,
) -> torch.Tensor:
    """Run `tokens` at `positions` over `cache` (appending their KV): logits (T_kept, V) fp32, on the model's device."""
    device = model.get_input_embeddings().weight.device
    plan = attention.placed(plan, device)
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    out = model(
        input_ids=ids, position_ids=positions.to(device)[None], cache=cache, use_cache=True,
        attention_plan=plan, logits_to_keep=logits_to_keep,
    )
    cache.note_appended(positions)
    return out.logits[0].float()
