"""The model shapes bench/gpu.py runs with random weights (HF config.json contents), and their tiny --quick forms."""

QWEN3_8B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
                intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
                rms_norm_eps=1e-6, torch_dtype="bfloat16", eos_token_id=2, bos_token_id=1, hidden_act="silu",
                attention_bias=False)
# Qwen3-30B-A3B: 48 layers of 128 experts, 8 per token (61 GB in bf16: the H200)
QWEN3_30B_A3B = dict(QWEN3_8B, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                     intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128)
# Qwen3.5-35B-A3B: transformers' Qwen3_5MoeTextConfig defaults; 30 Gated DeltaNet + 10 gated attention layers,
# 256 experts (8 per token) and a shared expert (~70 GB in bf16: the H200)
QWEN3_5_35B_A3B = dict(QWEN3_8B, model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"],
                       vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                       num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                       moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=8,
                       num_experts=256, full_attention_interval=4, max_position_embeddings=65536,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
QWEN3_5_35B_A3B.pop("rope_theta")
QWEN3_5_35B_A3B.pop("intermediate_size")
# Qwen3.5-122B-A10B: 36 Gated DeltaNet + 12 gated attention layers, 256 experts of 1024 (8 per token) and a shared
# expert of 1024 (244 GB in bf16: split over two H200s by expert parallelism, 128 GB a GPU). The values of
# Qwen/Qwen3.5-122B-A10B's config.json as quoted by third parties (not read from the file itself): a Rust engine's
# constants "from Qwen/Qwen3.5-122B-A10B/config.json", slime's Megatron script and a KV note citing the config
# agree; rope and max_position_embeddings as the 35B shape
QWEN3_5_122B_A10B = dict(QWEN3_5_35B_A3B, vocab_size=248320, hidden_size=3072, num_hidden_layers=48,
                         num_attention_heads=32, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
                         linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                         linear_num_value_heads=64, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
                         num_experts_per_tok=8, num_experts=256, full_attention_interval=4)
SHAPES = {"qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
          "qwen3.5-122b-a10b": QWEN3_5_122B_A10B}
QUICK = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)
QUICK_MOE = dict(QUICK, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)
QUICK_HYBRID = dict(QUICK_MOE, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=64, linear_value_head_dim=64, shared_expert_intermediate_size=128)


def chosen_shape(name: str, quick: bool) -> dict:
    """SHAPES[name], or with --quick its family's tiny form (hybrid, MoE or dense)."""
    shape = SHAPES[name]
    if not quick:
        return shape
    return {**shape, **(QUICK_HYBRID if shape.get("linear_num_value_heads") else
                        QUICK_MOE if shape.get("num_experts") else QUICK)}


def add_engine_args(ap, out_name: str) -> None:
    """The options every engine-shape benchmark takes: --shape, --quick, --device, --tokenizer, --commit, --out."""
    import os

    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--quick", action="store_true", help="tiny shape and sizes (the control flow)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokenizer", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), ".peer", "tokenizer"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), out_name))
