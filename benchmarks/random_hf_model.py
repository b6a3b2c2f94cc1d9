"""A random-weight Hugging Face model directory of a named shape around a real tokenizer.

Grammars (structured outputs) and chat templates need a tokenizer, which dummy weights lack, and no
weights can be downloaded here: this saves a Llama-architecture model of one of the engine's dummy
shapes (its vocabulary the tokenizer's) with `save_pretrained`, plus the tokenizer's files, so
`LLM(model=OUT)` and transformers load the same weights.

    python benchmarks/random_hf_model.py --tokenizer DIR --shape llama-3.2-1b --out /tmp/m [--layers 4]
"""

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from chatengine.engine.loader import DUMMY_SHAPES  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def make(tokenizer_dir: Path, shape: str, out: Path, layers: int | None, dtype: torch.dtype, seed: int) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    s = dict(DUMMY_SHAPES[shape])
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=layers or s["num_layers"],
        num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"],
        head_dim=s["head_dim"],
        rms_norm_eps=s["rms_norm_eps"],
        rope_theta=s["rope_theta"],
        rope_scaling=s.get("rope_scaling"),
        max_position_embeddings=s["max_position_embeddings"],
        tie_word_embeddings=s["tie_word_embeddings"],
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, type=Path, help="a directory with tokenizer.json")
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(DUMMY_SHAPES))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    make(args.tokenizer, args.shape, args.out, args.layers, getattr(torch, args.dtype), args.seed)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
