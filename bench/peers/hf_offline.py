"""The HF transformers offline baseline: `model.generate` on the fixed chat prompts, batch 1 and batched.

    python bench/peers/hf_offline.py --model DIR --concurrency 32 256 --output-len 128 --threads 2

Each concurrency N runs the first N prompts (cycled) as batches of at most `--max-batch-size`, left
padded, with `min_new_tokens = max_new_tokens` so every request produces exactly `--output-len`
tokens, as `jaxserve bench offline` forces them. Writes a result in the offline format, so that
`jaxserve bench compare` puts it beside jaxserve's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `bench`


def run(model, tokenizer, prompts: list[list[int]], output_len: int, max_batch: int) -> dict:
    """Generate for every prompt in batches; output tokens/s over the whole wall time."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    t0 = time.perf_counter()
    produced = 0
    for start in range(0, len(prompts), max_batch):
        batch = prompts[start:start + max_batch]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)  # [B, L], left padded
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
        produced += (out.shape[1] - width) * len(batch)
    wall = time.perf_counter() - t0
    return {"num_requests": len(prompts), "output_tokens": produced, "wall_s": wall,
            "output_tok_s": produced / wall, "decode_step_s": None, "host_share": None}


def main(argv: list[str] | None = None) -> int:
    from bench.workloads import DEFAULT_PROMPTS, load_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 256])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset-path", default=str(DEFAULT_PROMPTS))
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--skip-batch1", action="store_true")
    p.add_argument("--result-file", default=None)
    ns = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.machine import machine_info
    from bench.offline import write_result

    if ns.threads:
        torch.set_num_threads(ns.threads)
    tokenizer = AutoTokenizer.from_pretrained(ns.model)
    model = AutoModelForCausalLM.from_pretrained(ns.model, dtype=getattr(torch, ns.dtype)).eval()
    convs = load_prompts(ns.dataset_path)

    def encode(conv):
        ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if not isinstance(ids, list) else ids)

    prompts = [encode(convs[i % len(convs)]) for i in range(max(ns.concurrency))]
    run(model, tokenizer, prompts[:1], 4, 1)  # untimed: first-call costs stay out
    result = {"kind": "offline", "system": f"hf-transformers-{ns.dtype}", "machine": machine_info(),
              "settings": {**vars(ns), "torch_threads": torch.get_num_threads()}, "runs": []}
    if not ns.skip_batch1:
        result["batch1"] = run(model, tokenizer, prompts[:1], ns.output_len, 1)
        print(f"batch 1: {result['batch1']['output_tok_s']:.1f} output tok/s", flush=True)
    for n in ns.concurrency:
        r = run(model, tokenizer, prompts[:n], ns.output_len, ns.max_batch_size)
        result["runs"].append({"concurrency": n, **r})
        print(f"{n} requests: {r['output_tok_s']:.1f} output tok/s ({r['wall_s']:.1f} s)", flush=True)
    path = write_result(result, ns.result_file, "offline-hf")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
