"""EAGLE heads: draft networks that read the target's hidden states, as their authors publish them.

A head is one decoder layer fed, per position, by a hidden state and the embedding of the NEXT token:
- EAGLE-1/2 ("eagle"): fc over [embedding; the target's last hidden state after its final norm], one Llama layer
  whose first norm is absent, and the target's own LM head on the layer's output.
- EAGLE-3 ("eagle3"): fc over three of the target's residual streams (entering layers 2, L//2 and L-3), one layer
  whose attention reads [normed embedding; normed hidden] (twice the width), its own norm and a reduced-vocabulary
  head whose draft id d is target id d + d2t[d].
Deeper draft tokens feed the head's own output back as the hidden state (through fc for EAGLE-1, directly for
EAGLE-3). A folder holds `config.json` and the weights as safetensors, `pytorch_model.bin` (read with
weights_only=True) or compact (`compact.COMPACT_FILE`, dequantized on load); keys `fc.*` and `layers.0.*` (EAGLE-1) or
`midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d` (EAGLE-3); the embedding is the target's unless the
folder has its own.
Knows head configs, weights and the forward; knows nothing of drafting policy, the engine or any UI.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from . import attention, compact
from .compat import FIXED_ROPE, rope_kind, rope_of
from .vocab import ReducedVocabHead

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
HEAD_NAME = {"eagle": "EAGLE head", "eagle3": "EAGLE-3 head"}


def feature_streams(kind: str, target_layers: int, config=None) -> tuple[int, ...]:
    """The target's residual streams a head reads: stream i enters layer i; stream L leaves the last layer (before
    the final norm). EAGLE-1 reads the last; EAGLE-3 the streams entering layers 2, L//2 and L-3, in that order, or
    those leaving the layers its config lists (`eagle_config.eagle_aux_hidden_state_layer_ids`, as some trainers
    write it: 1, L//2 - 1, L - 4 name the same streams)."""
    if kind == "eagle":
        return (target_layers,)
    listed = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if listed:
        return tuple(int(i) + 1 for i in listed)
    return (2, target_layers // 2, target_layers - 3)


@dataclass(frozen=True)
class HeadFolder:
    """What a head folder says before its weights load."""

    kind: str  # "eagle" or "eagle3"
    config: LlamaConfig
    weights: Path
    keys: frozenset[str]

    @property
    def draft_vocab(self) -> int:
        return int(getattr(self.config, "draft_vocab_size", None) or self.config.vocab_size)


def _weight_keys(path: Path) -> frozenset[str]:
    if path.suffix == ".gguf":
        return frozenset(compact.shapes(path))
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            return frozenset(f.keys())
    return frozenset(torch.load(path, map_location="meta", weights_only=True, mmap=True))


def head_folder(source: str | Path) -> Path | None:
    """A local folder for `source`: itself when it is a folder; for a hub id (fetched only where the operator allows
    the hub) the files of a head when its config names EAGLE-3 or a single layer (EAGLE-1 configs are plain Llama
    ones); None otherwise, and wherever the hub cannot be read (then the source is read as an ordinary model)."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists() or str(source).count("/") != 1:
        return None
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        raw = json.loads(Path(hf_hub_download(str(source), "config.json")).read_text())
        if EAGLE3_ARCHITECTURE not in (raw.get("architectures") or []) and raw.get("num_hidden_layers") != 1:
            return None
        return Path(snapshot_download(str(source), allow_patterns=["config.json", *WEIGHT_FILES]))
    except (OSError, ValueError, HfHubHTTPError):
        return None


def read_head(source: str | Path) -> HeadFolder | None:
    """The head a folder (or an allowed hub id) holds, or None when it holds none (an ordinary model, a GGUF)."""
    path = head_folder(source)
    if path is None:
        return None
    config_file = path / "config.json"
    weights = next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None) or compact.weights_file(path)
    if not config_file.is_file() or weights is None:
        return None
    raw = json.loads(config_file.read_text())
    keys = _weight_keys(weights)
    if EAGLE3_ARCHITECTURE in (raw.get("architectures") or []):
        kind = "eagle3"
    elif "fc.weight" not in keys:
        return None
    else:
        kind = "eagle3" if any(k.startswith("midlayer.") for k in keys) else "eagle"
    raw = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "num_hidden_layers")}
    config = LlamaConfig(**raw, num_hidden_layers=1)
    return HeadFolder(kind, config, weights, keys)


def config_like(target_config, draft_vocab: int | None = None, **changes) -> LlamaConfig:
    """A one-layer head config in its target's shapes (width, heads, MLP, RoPE, vocabulary), as EAGLE's heads are;
    `draft_vocab`: an EAGLE-3 head's reduced vocabulary."""
    tc = target_config
    fields = dict(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                  num_attention_heads=tc.num_attention_heads,
                  num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
                  head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
                  rms_norm_eps=tc.rms_norm_eps, rope_parameters=rope_of(tc) or None,
                  max_position_embeddings=tc.max_position_embeddings, vocab_size=tc.vocab_size, num_hidden_layers=1,
                  tie_word_embeddings=False)
    if draft_vocab is not None:
        fields["draft_vocab_size"] = draft_vocab
    return LlamaConfig(**{**fields, **changes})


def check_head(target_config, kind: str, cfg, own_embedding: bool, source: str | Path = "the head") -> None:
    """Refuse, with the reason, a head (`kind`, its config) that cannot read this target; decided from configs, before
    weights load (`own_embedding`: whether its weights hold an embedding)."""
    target_hidden = int(target_config.hidden_size)
    layers = int(target_config.num_hidden_layers)
    name = HEAD_NAME[kind]
    head_target = int(getattr(cfg, "target_hidden_size", None) or cfg.hidden_size)
    draft_vocab = int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
    if head_target != target_hidden:
        raise ValueError(f"{source}: an {name} for a target of hidden size {head_target}; this target's is "
                         f"{target_hidden}")
    if cfg.hidden_size != target_hidden and not own_embedding:
        raise ValueError(f"{source}: its width ({cfg.hidden_size}) differs from the target's ({target_hidden}) and it "
                         "ships no embedding of its own, so it cannot read the target's")
    if int(cfg.vocab_size) != int(target_config.vocab_size):
        raise ValueError(f"{source}: an {name} over {cfg.vocab_size} token ids; this target has {target_config.vocab_size}")
    if kind == "eagle3" and layers < 6:
        raise ValueError(f"{source}: an EAGLE-3 head reads the target's layers 2, L//2 and L-3; this target has "
                         f"only {layers} layers")
    streams = feature_streams(kind, layers, cfg)
    if kind == "eagle3" and (len(streams) != 3 or not all(1 <= i <= layers for i in streams)):
        raise ValueError(f"{source}: it reads the target's layers {[i - 1 for i in streams]}; this target has {layers}")
    if kind == "eagle" and cfg.hidden_size != target_hidden:
        raise ValueError(f"{source}: an EAGLE head's width ({cfg.hidden_size}) must be the target's ({target_hidden})")
    if rope_kind(cfg) not in FIXED_ROPE:
        raise ValueError(f"{source}: its RoPE scaling {rope_kind(cfg)!r} changes with the length; the engine runs "
                         f"{', '.join(FIXED_ROPE)}")
    if draft_vocab > int(cfg.vocab_size):
        raise ValueError(f"{source}: draft_vocab_size {draft_vocab} exceeds its vocab_size {cfg.vocab_size}")


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a head's weights file, read from its header (safetensors) or its pickle's metadata
    (`pytorch_model.bin`, mapped onto the meta device) or the compact file's header: no tensor is read."""
    if path.suffix == ".gguf":
        return compact.shapes(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    state = torch.load(path, map_location="meta", weights_only=True, mmap=True)
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


# the tensors whose shapes say most about the target a head was trained for, asked first
TELLING = ("fc.weight", "t2d", "embed_tokens.weight", "lm_head.weight", "d2t")


def check_weights(target_config, head: HeadFolder, source: str | Path = "the head", target_name: str = "") -> None:
    """Refuse, naming the head, the target and the first tensor that disagrees, a head whose weights' shapes (read
    from the file's header, `weight_shapes`) are not those its config and this target make (`target_name`: how the
    target is called, by default its config's path); before any weight is read into a module."""
    found = weight_shapes(head.weights)
    with torch.device("meta"):  # the head this target would build, in shapes only
        wanted = EagleHead(head.kind, copy.copy(head.config), SimpleNamespace(config=target_config), head.draft_vocab,
                           "embed_tokens.weight" in found, "fc.bias" in found).state_dict()
    misfits = [k for k in (*TELLING, *sorted(wanted)) if k in found and k in wanted and found[k] != tuple(wanted[k].shape)]
    if not misfits:
        return
    key, shape = misfits[0], found[misfits[0]]
    name, called = HEAD_NAME[head.kind], target_name or getattr(target_config, "name_or_path", "")
    target = f"the target {called}" if called else "this target"
    has = f"{key} {'x'.join(map(str, shape))}"
    width, vocab = int(target_config.hidden_size), int(target_config.vocab_size)
    if key == "fc.weight":
        streams = 3 if head.kind == "eagle3" else 2  # EAGLE-3 fuses three of the target's streams; EAGLE-1 [embedding; hidden]
        raise ValueError(f"{source}: this {name} expects a target of width {shape[-1] // streams} ({has}) but {target} "
                         f"has width {width}")
    if key in ("t2d", "embed_tokens.weight"):
        raise ValueError(f"{source}: this {name} expects a target of {shape[0]} token ids ({has}) but {target} has "
                         f"{vocab}")
    want = "x".join(map(str, wanted[key].shape))
    raise ValueError(f"{source}: this {name}'s weights do not fit {target} (width {width}, "
                     f"{target_config.num_hidden_layers} layers, {vocab} token ids) and its config.json: {has}, where "
                     f"{want} is needed")


def check_folder(target_config, head: HeadFolder, source: str | Path = "the head", target_name: str = "") -> None:
    """A head folder checked against a target before its weights load: its config (`check_head`), then its weights'
    shapes (`check_weights`)."""
    check_head(target_config, head.kind, head.config, "embed_tokens.weight" in head.keys, source)
    check_weights(target_config, head, source, target_name)


class HeadLayer(nn.Module):
    """The head's decoder layer: Llama attention and MLP; EAGLE-3 also norms the embedding and the hidden state
    and attends over both side by side."""

    def __init__(self, config: LlamaConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.self_attn = LlamaAttention(config, layer_idx=0)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if kind == "eagle3":
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            a = self.self_attn
            wide = 2 * config.hidden_size
            a.q_proj = nn.Linear(wide, a.q_proj.out_features, bias=a.q_proj.bias is not None)
            a.k_proj = nn.Linear(wide, a.k_proj.out_features, bias=a.k_proj.bias is not None)
            a.v_proj = nn.Linear(wide, a.v_proj.out_features, bias=a.v_proj.bias is not None)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, cache, mask=None,
                **kwargs) -> torch.Tensor:
        """(B, T, H) embeddings and hidden states -> (B, T, H)."""
        x = hidden
        if self.kind == "eagle3":
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        out, _ = self.self_attn(hidden_states=x, position_embeddings=position_embeddings, attention_mask=mask,
                                cache=cache, **kwargs)
        hidden = hidden + out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head bound to its target (whose embedding, LM head and final norm it may share)."""

    def __init__(self, kind: str, config: LlamaConfig, target, draft_vocab: int | None = None,
                 own_embedding: bool = False, fc_bias: bool = True) -> None:
        super().__init__()
        config._attn_implementation = attention.IMPLEMENTATION
        self.kind, self.config = kind, config
        tc = target.config
        self.streams = feature_streams(kind, tc.num_hidden_layers, config)
        hidden = config.hidden_size
        target_hidden = int(getattr(config, "target_hidden_size", None) or tc.hidden_size)
        if kind == "eagle":
            self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
            self.layers = nn.ModuleList([HeadLayer(config, kind)])
        else:
            self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
            self.midlayer = HeadLayer(config, kind)
            self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.draft_vocab = draft_vocab or config.vocab_size
            self.lm_head = nn.Linear(hidden, self.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embedding else None
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self._target = (target,)  # not a submodule: the target's weights stay the target's
        self._out: nn.Module | None = None

    @property
    def layer(self) -> HeadLayer:
        return self.layers[0] if self.kind == "eagle" else self.midlayer

    @property
    def target(self):
        return self._target[0]

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens if self.embed_tokens is not None else self.target.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        """The logits over the target's whole vocabulary: the target's LM head (EAGLE-1), or the head's own rows
        placed at their target ids with -inf elsewhere (EAGLE-3)."""
        if self.kind == "eagle":
            return self.target.get_output_embeddings()
        if self._out is None:
            ids = torch.arange(self.draft_vocab, device=self.d2t.device) + self.d2t
            self._out = ReducedVocabHead(self.lm_head.weight, ids, int(self.target.get_output_embeddings().out_features))
        return self._out

    def features(self, streams: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's captured streams {i: (B, T, H_t)} as this head's input: (B, T, F)."""
        if self.kind == "eagle":
            norm = self.target.base_model.norm
            return norm(streams[self.streams[0]])
        return torch.cat([streams[i] for i in self.streams], dim=-1)  # (B, T, 3 H_t)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache, from_target: bool,
                mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """ids (B, T) of the next tokens, hidden (B, T, F) from the target (`from_target`) or the head's own outputs
        (B, T, H), positions (B, T): the head's output states (B, T, H). `kwargs` reach the attention (the plan)."""
        embeds = self.get_input_embeddings()(ids).to(self.fc.weight.dtype)
        if self.kind == "eagle":
            h = self.fc(torch.cat([embeds, hidden], dim=-1))
        else:
            h = self.fc(hidden) if from_target else hidden
        return self.layer(embeds, h, self.rotary_emb(h, position_ids=positions), cache, mask, **kwargs)

    def draft_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits over the head's own vocabulary (the draft ids): (..., V_draft)."""
        if self.kind == "eagle":
            return self.target.get_output_embeddings()(states)
        return self.lm_head(self.norm(states))

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: (..., V)."""
        if self.kind == "eagle":
            return self.target.get_output_embeddings()(states)
        return self.get_output_embeddings()(self.norm(states))


def load_head(folder: str | Path, target, device: torch.device, dtype: torch.dtype,
              head: HeadFolder | None = None) -> EagleHead:
    """Load a head folder for `target` (checked first: `check_head`); its weights read as tensors only."""
    head = head or read_head(folder)
    if head is None:
        raise ValueError(f"{folder} holds no EAGLE head (config.json and fc.* weights)")
    check_folder(target.config, head, folder)
    if head.weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(head.weights))
    elif head.weights.suffix == ".gguf":
        state = compact.read(head.weights)
    else:
        state = torch.load(head.weights, map_location="cpu", weights_only=True)
    model = EagleHead(head.kind, head.config, target, head.draft_vocab, "embed_tokens.weight" in state,
                      fc_bias="fc.bias" in state)
    if head.kind == "eagle3" and "d2t" not in state:  # a full-vocabulary EAGLE-3 head: draft id = target id
        state = {**state, "d2t": model.d2t, "t2d": model.t2d}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}: its weights do not fit an {HEAD_NAME[head.kind]} (missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]})")
    return model.to(device=device, dtype=dtype).eval()
