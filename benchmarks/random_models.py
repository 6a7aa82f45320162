"""Writes a random Hugging Face checkpoint of a family's shape, for benchmarks of families
with no small published checkpoint (benchmarks/worker_step.py times its steps).

    python -m benchmarks.random_models {deepseek_v4,qwen3_moe} OUT_DIR

`deepseek_v4`: DeepSeek-V4-Flash's layer kinds, rates, window and proportions at 1/8 of its
width and 8 of its 43 layers (hidden 512, 64 experts of which 6 routed and a shared one, head
dim 512 with 64 rotating, csa every 4 tokens, hca every 128, a 128-token window).
`qwen3_moe`: Qwen3-30B-A3B's at 1/4 of its width and 8 of its 48 layers (hidden 512, 128
experts of which 8 routed, head dim 128).
"""

from __future__ import annotations

import argparse

CLASSES = {"deepseek_v4": "DeepseekV4", "qwen3_moe": "Qwen3Moe"}
SHAPES = {
    "deepseek_v4": dict(
        vocab_size=32000, hidden_size=512, moe_intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=8, head_dim=512, q_lora_rank=128, num_experts_per_tok=6, n_routed_experts=64,
        n_shared_experts=1, o_groups=2, o_lora_rank=128, index_n_heads=8, index_head_dim=128,
        index_topk=64, sliding_window=128, hc_mult=4, max_position_embeddings=4096,
        layer_types=["heavily_compressed_attention"] * 2 + ["compressed_sparse_attention",
                                                           "heavily_compressed_attention"] * 3,
    ),
    "qwen3_moe": dict(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=192,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=1, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
    ),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=sorted(SHAPES))
    p.add_argument("out")
    args = p.parse_args()
    import torch
    import transformers

    torch.manual_seed(0)
    name = CLASSES[args.family]
    config = getattr(transformers, f"{name}Config")(**SHAPES[args.family])
    getattr(transformers, f"{name}ForCausalLM")(config).save_pretrained(args.out)
    print(f"wrote a random {args.family} checkpoint to {args.out}")


if __name__ == "__main__":
    main()
