"""ModelArchConfig: one normalized view of a HF ``config.json`` for the dense model family, plus the
sparse-MoE fields of Qwen3-MoE and the hybrid fields of Qwen3-Next / Qwen3.5 (Gated DeltaNet layers beside gated
full attention, zero-centred norms).

Where families read the same fields differently, their registry entry's ``ConfigMapping`` says how
(pipeline/models/registry.py); a model_type no entry names reads them the plain (Llama) way.

Reads both the transformers-5 style (``rope_parameters`` holding ``rope_theta``, ``rope_type`` and the
scaling fields) and the legacy style (top-level ``rope_theta`` plus ``rope_scaling`` with ``type`` or
``rope_type``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.dist.group import ExpertShard

# Scaling fields carried over from a rope dict (everything but the type and theta).
_ROPE_SCALING_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)


@dataclass(frozen=True, slots=True)
class ConfigMapping:
    """How one family's config.json maps onto ModelArchConfig, where families differ."""

    qk_norm: bool = False  # per-head RMSNorm on q and k before rope
    qkv_bias_only: bool = False  # biases on q/k/v and none on o_proj, whatever attention_bias says (Qwen2)
    sliding_window_switch: bool = False  # sliding_window applies only with use_sliding_window (Qwen2, Qwen3)
    # Gated DeltaNet and gated attention by layer_types (else every full_attention_interval-th layer attends),
    # zero-centred norms, partial rotary 0.25 unless the config says otherwise
    hybrid: bool = False
    all_layers_sparse: bool = False  # every layer MoE, top-k renormalised; no dense MLP, so no intermediate_size


PLAIN_MAPPING = ConfigMapping()


@dataclass(slots=True)
class ModelArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases
    o_proj_bias: bool = False  # llama/qwen3 `attention_bias` also puts a bias on o_proj; qwen2 does not
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (qwen3)
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    # rope
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # factor, original_max_position_embeddings, ...
    partial_rotary_factor: float = 1.0
    rope_interleaved: bool = False  # gptj layout; HF llama/qwen use neox (rotate-half)
    sliding_window: int | None = None  # recorded; not applied by the dense attention path
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # sparse MoE (Qwen3-MoE, Qwen3-Next); num_experts=0 means dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int | None = None
    # hybrid Gated DeltaNet (Qwen3-Next, Qwen3.5): "linear_attention" / "full_attention" per layer; () = all full
    layer_types: tuple[str, ...] = ()
    expert_shard: ExpertShard = ExpertShard()  # expert parallelism: the routed experts this rank holds (runtime)
    # expert parallelism with split recurrent states: the Gated DeltaNet heads this rank holds (runtime)
    linear_head_shard: ExpertShard = ExpertShard()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    attn_output_gate: bool = False  # q_proj also yields a per-head sigmoid gate on the attention output
    zero_centered_norm: bool = False  # RMSNorm weights w applied as (1 + w)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, d: dict[str, Any], mapping: ConfigMapping | None = None) -> "ModelArchConfig":
        """Normalize a HF config dict (``config.json`` contents or ``PretrainedConfig.to_dict()``); ``mapping``
        defaults to the registry entry's for its model_type."""
        d = dict(d)
        # Multimodal wrappers keep the language model under text_config.
        if "text_config" in d and "hidden_size" not in d:
            d = {**d["text_config"], "model_type": d["text_config"].get("model_type", d.get("model_type"))}
        model_type = d.get("model_type")
        if not model_type:
            raise ValueError("HF config has no model_type")
        if mapping is None:
            # the registry sits above this module (its families build on ModelArchConfig): imported when it runs
            from pipeline.models.registry import config_mapping

            mapping = config_mapping(model_type)
        try:
            hidden = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            num_layers = int(d["num_hidden_layers"])
            vocab = int(d["vocab_size"])
            # Qwen3.5-MoE has no dense MLP, so its config has no intermediate_size
            inter = int(d["intermediate_size"]) if not mapping.all_layers_sparse else int(
                d.get("intermediate_size") or 0)
        except KeyError as e:
            raise ValueError(f"HF config for {model_type!r} lacks required field {e.args[0]!r}") from None
        num_kv_heads = d.get("num_key_value_heads") or num_heads
        head_dim = d.get("head_dim") or hidden // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")

        bias = bool(d.get("attention_bias", False))
        if mapping.qkv_bias_only:
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias, o_proj_bias = bias, bias

        theta, rope_type, scaling, partial = _parse_rope(d)

        sliding = None
        if mapping.sliding_window_switch:
            if d.get("use_sliding_window"):
                sliding = d.get("sliding_window")
        else:
            sliding = d.get("sliding_window")

        hybrid = mapping.hybrid
        layer_types = tuple(d.get("layer_types") or ())
        if hybrid and not layer_types:
            interval = int(d.get("full_attention_interval") or 4)
            layer_types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                for i in range(num_layers))
        if layer_types and (len(layer_types) != num_layers or
                            set(layer_types) - {"linear_attention", "full_attention"}):
            raise ValueError(f"layer_types {list(layer_types)} do not describe {num_layers} layers of "
                             "'linear_attention' / 'full_attention'")
        if hybrid and d.get("partial_rotary_factor") is None and "partial_rotary_factor" not in (
                d.get("rope_parameters") or {}):
            partial = 0.25  # transformers' default for these families
        always_routed = mapping.all_layers_sparse

        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=mapping.qk_norm,
            hidden_act=d.get("hidden_act", "silu"),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_type=rope_type,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            sliding_window=sliding,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            # transformers' Qwen3MoeConfig.to_dict() writes num_experts as num_local_experts
            num_experts=int(d.get("num_experts") or d.get("num_local_experts") or 0),
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
            norm_topk_prob=True if always_routed else bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=1 if always_routed else int(d.get("decoder_sparse_step") or 1),
            mlp_only_layers=() if always_routed else tuple(int(i) for i in (d.get("mlp_only_layers") or ())),
            shared_expert_intermediate_size=int(d["shared_expert_intermediate_size"])
            if d.get("shared_expert_intermediate_size") else None,
            layer_types=layer_types,
            linear_num_key_heads=int(d.get("linear_num_key_heads") or 0),
            linear_num_value_heads=int(d.get("linear_num_value_heads") or 0),
            linear_key_head_dim=int(d.get("linear_key_head_dim") or 0),
            linear_value_head_dim=int(d.get("linear_value_head_dim") or 0),
            linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim") or 4),
            attn_output_gate=hybrid,
            zero_centered_norm=hybrid,
            hf_config=d,
        )


def _parse_rope(d: dict[str, Any]) -> tuple[float, str, dict[str, Any], float]:
    """-> (rope_theta, rope_type, scaling fields, partial_rotary_factor)."""
    params = d.get("rope_parameters")
    legacy = d.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a dict, got {type(params).__name__}")
    if params and any(isinstance(v, dict) for v in params.values()):
        raise NotImplementedError("per-layer-type rope_parameters are not supported by the dense model family")
    merged: dict[str, Any] = {}
    if isinstance(legacy, dict):
        merged.update(legacy)
    if params:
        merged.update(params)
    theta = merged.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    partial = merged.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    scaling = {k: merged[k] for k in _ROPE_SCALING_KEYS if k in merged and merged[k] is not None}
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers: the top-level field wins (phi3 style), else the dict's, else max_position_embeddings
        orig = d.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(orig or d.get("max_position_embeddings", 2048))
    return float(theta), str(rope_type), scaling, float(partial if partial is not None else 1.0)
